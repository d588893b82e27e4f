"""Bad input to the public API fails at once with an error that names the argument and the fix,
not deep inside the maths (each case raised an unrelated error before it was checked)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp4stack
from fp4stack.nn.linear import QuantLinear
from fp4stack.optim import AdamW4
from fp4stack.optim.muon4 import Muon4

X = torch.randn(4, 64)


@pytest.mark.parametrize("fn", [fp4stack.quantize, fp4stack.fake_quantize])
@pytest.mark.parametrize("seed", ["abc", 1.5, True])
def test_a_seed_must_be_an_int(fn, seed):
    with pytest.raises(TypeError, match="seed must be an int"):
        fn(X, rounding="stochastic", seed=seed)


def test_seeds_of_any_size_work_and_repeat():
    big = 2**70 + 12345
    a = fp4stack.fake_quantize(X, rounding="stochastic", seed=big)
    assert torch.equal(a, fp4stack.fake_quantize(X, rounding="stochastic", seed=big))


@pytest.mark.parametrize("fn", [fp4stack.quantize, fp4stack.fake_quantize])
def test_spec_must_be_a_quantspec(fn):
    with pytest.raises(TypeError, match="spec must be a QuantSpec, got dict"):
        fn(X, spec={"block": (1, 16)})


def test_from_linear_takes_a_linear():
    with pytest.raises(TypeError, match="takes an nn.Linear, got Conv1d"):
        QuantLinear.from_linear(nn.Conv1d(4, 4, 1), "nvfp4")


@pytest.mark.parametrize("field", ["x", "w", "dy", "dy_wgrad"])
def test_recipe_operands_must_be_specs(field):
    with pytest.raises(TypeError, match=f"Recipe.{field} must be a QuantSpec"):
        fp4stack.recipe("nvfp4").with_(**{field: "fast"})


def test_a_backward_operand_may_be_none_to_reuse_the_forwards():
    r = fp4stack.recipe("nvfp4").with_(w_dgrad=None, x_wgrad=None)
    assert r.w_dgrad is None and r.x_wgrad is None
    with pytest.raises(TypeError, match="Recipe.w must be a QuantSpec"):
        fp4stack.recipe("nvfp4").with_(w=None)


@pytest.mark.parametrize("make", [
    lambda p, **kw: AdamW4([p], **kw),
    lambda p, **kw: Muon4([p], **kw),
])
@pytest.mark.parametrize("lr", ["0.1", float("nan"), -1.0])
def test_optimizers_name_a_bad_learning_rate(make, lr):
    with pytest.raises(ValueError, match=r"lr \(the learning rate\) must be"):
        make(nn.Parameter(torch.randn(64, 64)), lr=lr)


@pytest.mark.parametrize("fn", [fp4stack.quantize_fp8, fp4stack.fake_quantize_fp8])
def test_fp8_takes_floats_only_as_nvfp4_does(fn):
    with pytest.raises(TypeError, match="FP8 quantizes float32, bfloat16 or float16, got"):
        fn(torch.arange(64).reshape(2, 32))


@pytest.mark.parametrize("fn", [fp4stack.quantize_fp8, fp4stack.fake_quantize_fp8])
def test_fp8_refuses_nan_as_nvfp4_does_unless_propagated(fn):
    x = X.clone()
    x[0, 3] = float("nan")
    with pytest.raises(ValueError, match="1 of 256 values are NaN or Inf"):
        fp4stack.quantize(x)
    with pytest.raises(ValueError, match="1 of 256 values are NaN or Inf"):
        fn(x)
    fn(x, nan_policy="propagate")  # no check, as NVFP4's nan_policy="propagate"


def test_the_fp8_recipes_propagate_nan_on_the_hot_path_as_the_nvfp4_ones_do():
    for name in ("fp8", "w8a8", "nvfp4"):
        r = fp4stack.recipe(name)
        assert {r.x.nan_policy, r.w.nan_policy} == {"propagate"}, name


@pytest.mark.parametrize("spec", ["arithmetic", "arithmetic:add"])
def test_a_misspelt_task_option_is_named(spec):
    from fp4stack.data.tasks import load_task

    with pytest.raises(ValueError, match=r"unknown task option 'levle' \(did you mean 'level'"):
        load_task(spec, levle=2)
    assert load_task(spec, level=2, n_test=5).test_set()


@pytest.mark.parametrize("load", ["pretrain", "rl", "recipe"])
def test_a_broken_yaml_file_is_named_with_its_line(tmp_path, load):
    from fp4stack.rl.config import load_rl_config
    from fp4stack.train.config import load_config, recipe_arg

    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  dim: 64\n   n_layers: [2\n")
    fn = {"pretrain": load_config, "rl": load_rl_config, "recipe": recipe_arg}[load]
    with pytest.raises(ValueError, match=r"broken.yaml: not valid YAML at line \d+, column \d+"):
        fn(str(path))


def test_a_manifest_vocab_below_the_datas_is_named(tmp_path):
    import json

    import numpy as np

    from fp4stack.data.shards import TokenShards, write_shard

    write_shard(tmp_path / "train.bin", np.arange(300), vocab_size=300)
    (tmp_path / "manifest.json").write_text(json.dumps({"vocab_size": 300}))
    assert len(TokenShards(tmp_path)) == 300
    (tmp_path / "manifest.json").write_text(json.dumps({"vocab_size": 200}))
    with pytest.raises(ValueError, match="holds token id 299, but .* says vocab_size 200"):
        TokenShards(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"vocab": 300}))
    with pytest.raises(ValueError, match="vocab_size must be an integer"):
        TokenShards(tmp_path)


def test_the_low_64_bits_of_a_seed_count():
    from fp4stack.formats.random import seed_keys

    assert seed_keys(5) == seed_keys(5 + 2**64) == seed_keys(5 - 2**64)
    assert seed_keys(5) != seed_keys(5 + 2**40)
