"""Packed NVFP4 state: tensors held as buffers under the checkpoints' keys, and read back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp4stack
from fp4stack import QuantLinear, QuantSpec
from fp4stack.models import GPT, GPTConfig
from fp4stack.nn.moe import Experts
from fp4stack.nn.packed import PackedSlot, PackedState
from fp4stack.nn.quant_experts import QuantExperts


class Holder(PackedState, nn.Module):
    pass


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def same(a, b) -> bool:
    return (torch.equal(a.data, b.data) and torch.equal(a.scales.view(torch.uint8),
                                                        b.scales.view(torch.uint8))
            and torch.equal(a.amax, b.amax) and a.shape == b.shape and a.spec == b.spec)


def test_a_single_tensor_round_trips_under_its_keys():
    t = fp4stack.quantize(randn(8, 48), four_over_six=True)
    m = Holder()
    m.register_packed(PackedSlot("weight", master="weight", shape=t.shape, spec=t.spec), [t])
    assert list(m.state_dict()) == ["weight_data", "weight_scales", "weight_global_amax"]
    assert same(m.read_packed("weight"), t)
    assert [(n, same(u, t)) for n, u in m.packed_tensors()] == [("weight", True)]


def test_a_stack_round_trips_one_entry_at_a_time():
    ts = [fp4stack.quantize(randn(6, 32, seed=e)) for e in range(3)]
    m = Holder()
    m.register_packed(PackedSlot("down", master="down_proj", shape=ts[0].shape, spec=ts[0].spec,
                                 amax_key="amax", count=3), ts)
    sd = m.state_dict()
    assert list(sd) == ["down_data", "down_scales", "down_amax"]
    assert sd["down_data"].shape == (3, 6, 16) and sd["down_amax"].shape == (3,)
    assert all(same(m.read_packed("down", e), ts[e]) for e in range(3))
    assert [n for n, _ in m.packed_tensors()] == ["down[0]", "down[1]", "down[2]"]
    new = [fp4stack.quantize(randn(6, 32, seed=10 + e)) for e in range(3)]
    m.write_packed("down", new)
    assert all(same(m.read_packed("down", e), new[e]) for e in range(3))


def test_a_slot_refuses_what_it_cannot_hold():
    t = fp4stack.quantize(randn(4, 32))
    slot = PackedSlot("w", master="w", shape=t.shape, spec=t.spec)
    with pytest.raises(ValueError, match="holds 1 tensors, got 2"):
        slot.state([t, t])
    with pytest.raises(ValueError, match="quantize with the slot's spec"):
        slot.state([fp4stack.quantize(randn(4, 32), four_over_six=True)])
    with pytest.raises(ValueError, match="quantize with the slot's spec"):
        slot.state([fp4stack.quantize(randn(4, 48))])
    m = Holder()
    m.register_packed(slot, [t])
    with pytest.raises(ValueError, match="a single tensor: pass no index"):
        m.read_packed("w", 0)
    with pytest.raises(KeyError, match="no packed tensor 'v'"):
        m.read_packed("v")
    stack = PackedSlot("s", master="s", shape=t.shape, spec=t.spec, count=2)
    m.register_packed(stack, [t, t])
    with pytest.raises(ValueError, match="a stack of 2: pass an index"):
        m.read_packed("s")


def test_quant_linear_keeps_its_state_dict_keys_and_loads_them_back():
    lin = nn.Linear(64, 48)
    layer = QuantLinear.from_linear(lin, "w4a4")
    assert list(layer.state_dict()) == ["bias", "weight_data", "weight_scales",
                                        "weight_global_amax"]
    want = fp4stack.quantize(lin.weight.detach(), spec=layer.recipe.w)
    assert same(layer.packed_weight, want) and layer.packed_spec == want.spec
    assert [n for n, _ in layer.packed_tensors()] == ["weight"]
    other = QuantLinear.from_linear(nn.Linear(64, 48), "w4a4")
    other.load_state_dict(layer.state_dict())
    assert same(other.packed_weight, want)
    master = QuantLinear.from_linear(nn.Linear(64, 48), "qat-w")
    assert master.packed_weight is None and master.packed_spec is None
    assert list(master.packed_tensors()) == []


def test_converted_model_keys_are_unchanged():
    # The keys of a packed GPT: the fused groups' pinned amax stays, next to the packed weight.
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny_moe(n_layers=2))
    fp4stack.quantize_model(model, "w4a4")
    keys = set(model.state_dict())
    attn = "model.layers.0.self_attn.q_proj"
    assert {f"{attn}.weight_data", f"{attn}.weight_scales", f"{attn}.weight_global_amax",
            f"{attn}.weight_amax"} <= keys
    experts = [n for n, m in model.named_modules() if isinstance(m, QuantExperts)]
    assert experts
    for name in experts:
        assert {f"{name}.{p}_{s}" for p in ("gate_up", "down")
                for s in ("data", "scales", "amax")} <= keys
    assert not any(k.endswith(("_proj", ".weight")) and k.startswith(tuple(experts))
                   for k in keys)


def test_quant_experts_pack_each_expert_on_its_own():
    torch.manual_seed(0)
    experts = Experts(32, 16, 3)
    gate_up = experts.gate_up_proj.detach().clone()
    q = QuantExperts.from_experts(experts, fp4stack.recipe("w4a4"))
    spec = q.recipe.w
    assert q.gate_up_proj is None and q.packed_slots()["gate_up"].count == 3
    for e in range(3):
        assert same(q.packed_expert("gate_up", e), fp4stack.quantize(gate_up[e], spec=spec))
    names = [n for n, _ in q.packed_tensors()]
    assert names == [f"{p}[{e}]" for p in ("gate_up", "down") for e in range(3)]
    again = QuantExperts.from_experts(Experts(32, 16, 3), fp4stack.recipe("w4a4"))
    again.load_state_dict(q.state_dict())
    assert all(same(a, b) for (_, a), (_, b) in zip(again.packed_tensors(), q.packed_tensors(),
                                                    strict=True))


def test_spec_is_kept_with_the_slot():
    spec = QuantSpec(block=(16, 16), four_over_six=True)
    t = fp4stack.quantize(randn(32, 32), spec=spec)
    m = Holder()
    m.register_packed(PackedSlot("weight", master="weight", shape=t.shape, spec=spec), [t])
    assert m.packed_slots()["weight"].spec == spec == m.read_packed("weight").spec
