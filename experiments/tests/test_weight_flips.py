"""WeightFlips counts the forward's NVFP4 weight changes exactly, and the trainer logs them."""

from __future__ import annotations

import plot_weight_flips
import pytest
import torch
from test_train import config, make_data

from fp4stack.analysis.weight_flips import WeightFlips, block_values
from fp4stack.api import dequantize, quantize
from fp4stack.nn.linear import QuantLinear
from fp4stack.nn.recipe import recipe
from fp4stack.train import read_metrics, train


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("flips") / "data")


def layer(preset: str, out_features: int = 32, in_features: int = 48) -> QuantLinear:
    torch.manual_seed(0)
    return QuantLinear.from_linear(torch.nn.Linear(in_features, out_features, bias=False),
                                   recipe(preset))


@pytest.mark.parametrize("preset", ["nvfp4", "nvfp4-nvidia", "fullstack-nvidia-rotated"])
def test_keys_tell_the_forwards_values_apart(preset):
    # With the global amax fixed, two values before the global scale are equal iff the forward
    # multiplies by the same value.
    lin = layer(preset)
    spec, amax = lin.recipe.w, lin.weight.detach().abs().amax()
    before = block_values(lin)
    deq_before = dequantize(quantize(lin.weight.detach(), spec=spec, amax=amax))
    with torch.no_grad():
        lin.weight.add_(torch.randn_like(lin.weight) * 0.02).clamp_(-amax, amax)
    after = block_values(lin)
    deq_after = dequantize(quantize(lin.weight.detach(), spec=spec, amax=amax))
    k = lin.in_features
    changed = (before != after)[..., :k]
    assert changed.shape == deq_before.shape
    assert 0 < changed.float().mean() < 1
    assert torch.equal(changed, deq_before != deq_after)


def test_flip_and_return_rates_count_exact_changes():
    lin = layer("nvfp4", out_features=2, in_features=32)
    with torch.no_grad():  # every block's max is 6: its scale stays put when one value moves
        lin.weight.fill_(3.0)
        lin.weight[:, 0] = 6.0
    flips = WeightFlips(torch.nn.Sequential(lin))
    assert flips.numel == 64
    flips.observe()  # unchanged
    assert flips.report() == {"weight_flip_rate": 0.0, "weight_return_rate": 0.0}
    with torch.no_grad():
        lin.weight[1, 5] = 1.0
    flips.observe()  # 3 -> 1: a flip
    with torch.no_grad():
        lin.weight[1, 5] = 3.0
        lin.weight[0, 7] = 2.0
    flips.observe()  # 1 -> 3 returns; 3 -> 2 is a new flip
    with torch.no_grad():
        lin.weight[1, 5] = 3.1  # rounds to 3 again: no flip
    flips.observe()
    report = flips.report()
    assert report["weight_flip_rate"] == pytest.approx((1 + 2 + 0) / 64 / 3)
    assert report["weight_return_rate"] == pytest.approx((0 + 1 + 0) / 64 / 3)
    assert flips.report() == {}


def test_a_model_without_nvfp4_weights_is_refused():
    with pytest.raises(ValueError, match="no QuantLinear with an NVFP4 forward weight"):
        WeightFlips(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_training_logs_the_rates(data, tmp_path):
    train(config(data, tmp_path, recipe="nvfp4-nvidia", max_steps=6, log_every=2, eval_every=6,
                 weight_flips=True))
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [2, 4, 6]
    for r in records:
        assert 0 < r["weight_flip_rate"] < 1
        assert 0 <= r["weight_return_rate"] <= r["weight_flip_rate"]
    x, flips, returns = plot_weight_flips.flip_curves(tmp_path)
    assert x == [2 / 6, 4 / 6, 1.0]
    assert flips == [r["weight_flip_rate"] for r in records]
    assert returns == [r["weight_return_rate"] for r in records]
    plot_weight_flips.main([str(tmp_path), "--out", str(tmp_path / "flips.png")])
    assert (tmp_path / "flips.png").stat().st_size > 0


def test_weight_flips_needs_quantized_weights(data, tmp_path):
    for preset in ("bf16", "fp8"):
        with pytest.raises(ValueError, match=f"weight_flips: recipe '{preset}' does not quantize"):
            config(data, tmp_path, recipe=preset, weight_flips=True)
