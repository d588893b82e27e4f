"""nn.operands.weight_operands_once: the weights' quantized operands made once per optimizer
step, not once per micro-batch, with the same bits (the trainer's forward_backward uses it)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from fp4stack import recipe
from fp4stack.formats.spec import QuantSpec
from fp4stack.models.gpt import GPT, GPTConfig
from fp4stack.nn import operands
from fp4stack.nn.linear import QuantLinear
from fp4stack.nn.operands import weight_operands_once
from fp4stack.train import trainer

pytestmark = pytest.mark.usefixtures("one_thread")
SR_WEIGHTS = recipe("nvfp4").with_(name="sr-w", w=QuantSpec(rounding="stochastic"))


def model(name) -> GPT:
    torch.manual_seed(0)
    gpt = GPT(GPTConfig.tiny(vocab_size=64, n_layers=3))  # nvfp4-nvidia: one block quantized
    from fp4stack.convert import quantize_model

    quantize_model(gpt, recipe(name) if isinstance(name, str) else name)
    return gpt


def batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (8, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def step(name, cached: bool, monkeypatch):
    """Loss and gradients of one 4-micro-batch step, and how many weight quantizations ran
    (rounded to nearest, stochastically)."""
    if not cached:
        monkeypatch.setattr(trainer, "weight_operands_once", nullcontext)
    calls = []
    real = operands.quantize_operand

    def counted(t, spec, *a, **k):
        if isinstance(t, torch.nn.Parameter) and spec is not None:
            calls.append(spec.rounding)
        return real(t, spec, *a, **k)

    monkeypatch.setattr(operands, "quantize_operand", counted)
    gpt, (x, y) = model(name), batch()
    torch.manual_seed(5)  # the stochastic roundings' draws
    loss = trainer.forward_backward(gpt, x, y, 2, False, nullcontext())
    monkeypatch.undo()
    return [loss] + [p.grad for p in gpt.parameters()], (calls.count("rne"),
                                                           calls.count("stochastic"))


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4-nvidia", "fp8", SR_WEIGHTS],
                         ids=["nvfp4", "nvfp4-nvidia", "fp8", "sr-weights"])
def test_a_step_gives_the_same_bits_with_fewer_weight_quantizations(name, monkeypatch):
    (eager, n_eager), (cached, n_cached) = (step(name, c, monkeypatch) for c in (False, True))
    assert all(torch.equal(a, b) for a, b in zip(eager, cached, strict=True))
    # 4 micro-batches: each round-to-nearest weight operand once instead of four times; the
    # stochastic ones are drawn afresh for every micro-batch.
    assert n_cached[0] > 0 and n_eager[0] == 4 * n_cached[0]
    assert n_eager[1] == n_cached[1] and (n_cached[1] > 0) == (name is SR_WEIGHTS)


def test_an_in_place_change_quantizes_again_and_exit_drops_the_cache():
    layer = QuantLinear(32, 16, bias=False, recipe="nvfp4")
    x = torch.randn(4, 32)
    with torch.no_grad(), weight_operands_once():
        a = layer(x)  # Q(W) and the backward's column-wise Q(W)
        assert len(operands._STEP_WEIGHTS) == 2 and torch.equal(layer(x), a)
        assert len(operands._STEP_WEIGHTS) == 2
        layer.weight.mul_(2)  # the version counter moves: new operands
        b = layer(x)
        assert len(operands._STEP_WEIGHTS) == 4
        with weight_operands_once():  # nested: the same cache
            assert torch.equal(layer(x), b)
        assert operands._STEP_WEIGHTS is not None
    assert operands._STEP_WEIGHTS is None
    with torch.no_grad():
        assert torch.equal(layer(x), b)
    torch.testing.assert_close(b, 2 * a, rtol=0, atol=0)  # scaling by 2 is exact in NVFP4


P = dict(nan_policy="propagate")


@pytest.mark.parametrize(("specs", "shares"), [
    ((QuantSpec(**P), QuantSpec(**P)), True),
    ((QuantSpec(**P), QuantSpec(rounding="stochastic", four_over_six=True, **P)), True),
    ((QuantSpec(**P), QuantSpec(hadamard=True, **P)), False),  # amax of the transformed tensor
    ((QuantSpec(**P), QuantSpec(global_scale="row", **P)), False),  # one amax a row
    ((QuantSpec(**P), QuantSpec()), False),  # a NaN check must see the tensor itself
    ((QuantSpec(**P), QuantSpec.fp8()), False),
    ((QuantSpec(**P), None), False),
])
def test_one_amax_serves_an_operand_and_its_columnwise_copy(specs, shares):
    # The row-wise and column-wise quantizations of x share max |x| when both specs compute it
    # plainly; the operands are then bit-identical to quantizing each with its own amax.
    x = torch.randn(40, 64)
    x[3, 5] = -30.0
    amax = operands.common_amax(x, *specs)
    assert (amax is not None) == shares
    if shares:
        assert torch.equal(amax, x.abs().amax())
        for columnwise, spec in zip((False, True), specs, strict=True):
            torch.manual_seed(1)
            own = operands.quantize_operand(x, spec, columnwise=columnwise, seed=3)
            given = operands.quantize_operand(x, spec, amax, columnwise=columnwise, seed=3)
            assert torch.equal(own, given)
