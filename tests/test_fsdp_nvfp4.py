"""train/fsdp_nvfp4.py in one process: which layers FSDP2 may all-gather in NVFP4, the weight
subclass's behaviour as its fp32 data, and the all-gather's byte layout: the ranks' rows
quantized one by one, concatenated as FSDP2 concatenates them, and read back, are the whole
weight's Q(W) and column-wise Q(W) bit for bit. The two-process runs are in
test_fsdp2_quantized.py (values) and test_distributed.py (training runs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fp4stack.formats.spec import QuantSpec
from fp4stack.nn.linear import QuantLinear
from fp4stack.nn.operands import quantize_operand
from fp4stack.nn.recipe import recipe
from fp4stack.optim.shard_local import local_shard
from fp4stack.train.config import PretrainConfig
from fp4stack.train.fsdp_nvfp4 import GatherPlan, NVFP4GatherWeight, ineligible, unwrap


def _layer(rows: int, name: str = "nvfp4", cols: int = 64) -> QuantLinear:
    torch.manual_seed(0)
    return QuantLinear(cols, rows, bias=False, recipe=recipe(name))


@pytest.mark.parametrize(("name", "rows", "why"), [
    ("nvfp4", 64, None),
    ("qat-w", 64, None),
    ("nvfp4-4over6", 64, None),
    ("nvfp4-nvidia", 64, None),
    ("qat-w", 24, None),  # 1x16 blocks only, no dgrad copy: any even split of the rows
    ("nvfp4", 24, "not a multiple of 32"),  # the dgrad copy's blocks span 16 rows
    ("nvfp4-nvidia", 48, "not a multiple of 32"),  # 16x16 tiles
    ("lowrank", 64, None),  # its branch's refit gathers W's rows
    ("fullstack-nvidia-noreuse", 64, None),
    ("lowrank-svd", 64, "SVDQuant's split"),
    ("w4a4-rc", 64, "compensated"),
    ("fp8", 64, "not NVFP4"),
    ("bf16", 64, "not quantized"),
])
def test_which_layers_gather_in_nvfp4(name, rows, why):
    got = ineligible(_layer(rows, name), shards=2)
    assert (got is None) if why is None else (why in got), got


def test_stochastically_rounded_weights_keep_fp32():
    layer = _layer(64)
    layer.recipe = dataclasses.replace(layer.recipe, w=QuantSpec(rounding="stochastic"))
    assert "stochastic" in ineligible(layer, 2)
    layer.recipe = dataclasses.replace(recipe("nvfp4"), w_dgrad=QuantSpec(rounding="stochastic"))
    assert "stochastic" in ineligible(layer, 2)


def test_the_subclass_is_its_data_to_everything_but_fsdp2():
    data = torch.randn(8, 32)
    plan = GatherPlan(None, QuantSpec(), None, name="w")
    w = NVFP4GatherWeight(data.clone(), plan)
    # FSDP2's sharding ops keep the subclass (and its plan), so the shard keeps the hooks ...
    for t in (w.detach(), w.view(-1), w[2:4], *torch.chunk(w, 2), w.new_zeros((4, 32))):
        assert type(t) is NVFP4GatherWeight and t._plan is plan
    assert torch.equal(unwrap(torch.chunk(w, 2)[1]), data[4:])
    # ... every other op computes on the data and returns plain tensors, in place too.
    assert type(w * 2) is torch.Tensor and torch.equal(w * 2, data * 2)
    w.add_(1.0)
    assert torch.equal(unwrap(w), data + 1)
    p = torch.nn.Parameter(w)
    assert type(local_shard(p)) is torch.Tensor and torch.equal(local_shard(p), data + 1)
    assert local_shard(p).data_ptr() == unwrap(w).data_ptr()  # an alias: optimizers update it


def _gather(shards: list[NVFP4GatherWeight]) -> tuple[torch.Tensor, object]:
    """FSDP2's all-gather of the shards' NVFP4 bytes: each input of every rank in turn, then
    read back by fsdp_post_all_gather."""
    inputs, meta = zip(*(s.fsdp_pre_all_gather(None, None, None, None, None) for s in shards),
                       strict=True)
    outputs = [torch.cat([rank[i].reshape(-1) for rank in inputs]) for i in range(len(inputs[0]))]
    values, _ = shards[0].fsdp_post_all_gather(outputs, meta[0], torch.float32)
    return values, shards[0]._plan.layer()


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4-4over6", "nvfp4-nvidia", "qat-w"])
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_gathered_bytes_are_the_whole_weights_quantization(name, ranks):
    import weakref

    layer = _layer(64, name, cols=48)
    w = layer.weight.detach() * 3
    w[5, 7] = 40.0  # the global amax lies in one rank's rows
    r = layer.recipe
    plan = GatherPlan(weakref.ref(layer), r.w, r.w_dgrad, shards=ranks, name="w")
    plan.amax = w.abs().amax()
    plan.dgrad_amax = plan.amax if r.w_dgrad is not None else None
    shards = [NVFP4GatherWeight(rows.contiguous(), plan) for rows in torch.chunk(w, ranks)]
    values, got = _gather(shards)
    want = quantize_operand(w, r.w)
    assert torch.equal(values.view(torch.int32), want.view(torch.int32))
    if r.w_dgrad is None:
        assert got.gathered_dgrad is None
    else:
        from fp4stack.api import dequantize

        dgrad = dequantize(got.gathered_dgrad, torch.float32).t()
        want_d = quantize_operand(w, r.w_dgrad, columnwise=True)
        assert torch.equal(dgrad.view(torch.int32), want_d.view(torch.int32))
    per_element = 0.5625 * (1 if r.w_dgrad is None else 2)
    assert plan.stats["bytes"] == per_element * w.numel()


def test_a_gather_without_amax_says_what_sets_it():
    layer = _layer(32)
    w = NVFP4GatherWeight(layer.weight.detach().clone(), GatherPlan(None, QuantSpec(), None,
                                                                    name="q_proj.weight"))
    with pytest.raises(RuntimeError, match="q_proj.weight: NVFP4 all-gather before"):
        w.fsdp_pre_all_gather(None, None, None, None, None)


@pytest.mark.parametrize(("fields", "match"), [
    ({"fsdp_gather": "bf16"}, "fsdp_gather must be one of"),
    ({"fsdp_gather": "nvfp4"}, "needs distributed: fsdp2"),
    ({"fsdp_gather": "nvfp4", "distributed": "fsdp2", "high_precision_tail": 0.2},
     "use fsdp_gather: fp32 with a high-precision tail"),
])
def test_config_errors_name_the_field_and_the_fix(fields, match):
    with pytest.raises(ValueError, match=match):
        PretrainConfig(**fields)
    assert PretrainConfig(fsdp_gather="nvfp4", distributed="fsdp2").fsdp_gather == "nvfp4"
