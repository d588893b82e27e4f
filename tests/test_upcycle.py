"""Dense -> MoE upcycling of fp4stack's GPT and of tiny random Hugging Face models, offline: same
logits at init, expert layout, seeded router, quantization, gradients, routing record/replay."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from fp4stack.convert import quantize_model
from fp4stack.models import GPT, GPTConfig
from fp4stack.models.upcycle import moe_aux_loss, upcycle_gpt, upcycle_hf
from fp4stack.nn.moe import MoEBlock, record_routing, replay_routing

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def dense(seed=0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.tiny(**overrides))


def tokens(b=2, s=16, vocab=256, seed=1) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("n_experts", "top_k", "overrides"), [
    (4, 2, {}), (3, 1, dict(tie_embeddings=True)), (2, 2, dict(qk_norm=False))])
def test_upcycled_gpt_matches_dense(n_experts, top_k, overrides):
    model = dense(**overrides)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    idx = tokens()
    ref = model(idx)[0]
    moe = upcycle_gpt(model, n_experts, top_k)
    c = moe.config
    assert (c.moe, c.n_experts, c.top_k, c.moe_hidden) == (True, n_experts, top_k, 128)
    assert moe.model.config is c and not model.config.moe
    torch.testing.assert_close(moe(idx)[0], ref, rtol=1e-5, atol=1e-5)
    assert moe.aux_loss is not None
    # The dense model is untouched and shares no storage with the new one.
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    ptrs = {p.data_ptr() for p in model.parameters()}
    assert not ptrs & {p.data_ptr() for p in moe.parameters()}
    assert (moe.lm_head.weight is moe.model.embed_tokens.weight) == c.tie_embeddings


def test_expert_layout_and_router_init():
    model = dense()
    moe = upcycle_gpt(model, 4, 2, router_std=0.05, seed=3)
    for old, new in zip(model.model.layers, moe.model.layers, strict=True):
        mlp, block = old.mlp, new.mlp
        assert isinstance(block, MoEBlock)
        gate_up = torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight))
        for e in range(4):
            assert torch.equal(block.experts.gate_up_proj[e], gate_up)
            assert torch.equal(block.experts.down_proj[e], mlp.down_proj.weight)
        w = block.router.gate.weight
        assert w.shape == (4, 64) and abs(w.std().item() - 0.05) < 0.01
    r = [m.mlp.router.gate.weight for m in moe.model.layers]
    assert not torch.equal(r[0], r[1])  # each layer draws its own router
    again = upcycle_gpt(model, 4, 2, router_std=0.05, seed=3)
    other = upcycle_gpt(model, 4, 2, router_std=0.05, seed=4)
    assert torch.equal(again.model.layers[0].mlp.router.gate.weight, r[0])
    assert not torch.equal(other.model.layers[0].mlp.router.gate.weight, r[0])


def test_routing_spreads_over_all_experts():
    moe = upcycle_gpt(dense(), 4, 2)
    with moe.record_routing() as routing:
        moe(tokens(4, 32))
    for indices in routing.values():
        counts = torch.bincount(indices.flatten(), minlength=4)
        assert (counts > 0.1 * counts.sum() / 4).all()


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(n_experts=4, top_k=5), "top_k"), (dict(n_experts=0, top_k=1), "n_experts"),
    (dict(n_experts=4, top_k=2, router_std=0.0), "router_std"),
    (dict(n_experts=4, top_k=2, expert_noise=-1.0), "expert_noise")])
def test_upcycle_gpt_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        upcycle_gpt(dense(), **kwargs)


def test_upcycle_gpt_refuses_moe_model():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="GPTConfig.moe"):
        upcycle_gpt(GPT(GPTConfig.tiny_moe()), 4, 2)


def test_upcycled_gpt_trains_and_experts_diverge():
    moe = upcycle_gpt(dense(), 4, 2)
    opt = torch.optim.AdamW(moe.parameters(), lr=1e-3)
    idx = tokens(4, 17)
    _, loss = moe(idx[:, :-1], idx[:, 1:])
    loss.backward()
    for layer in moe.model.layers:
        g = layer.mlp.router.gate.weight.grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0  # from the aux loss
    opt.step()
    w = moe.model.layers[0].mlp.experts.gate_up_proj
    assert not torch.equal(w[0], w[1])  # different tokens, different updates


def test_expert_noise_perturbs_each_copy_reproducibly():
    model = dense()
    idx = tokens()
    ref = model(idx)[0]
    a = upcycle_gpt(model, 4, 2, expert_noise=0.01, seed=1)
    b = upcycle_gpt(model, 4, 2, expert_noise=0.01, seed=1)
    w = a.model.layers[0].mlp.experts.down_proj
    assert torch.equal(w, b.model.layers[0].mlp.experts.down_proj)
    assert not torch.equal(w[0], w[1])
    dense_w = model.model.layers[0].mlp.down_proj.weight
    rel = ((w[0] - dense_w).norm() / dense_w.norm()).item()
    assert 0.005 < rel < 0.02
    out = a(idx)[0]
    assert not torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref, rtol=0.05, atol=0.01)


# Hugging Face dense models.

transformers = pytest.importorskip("transformers")
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def hf_model(kind="llama", **overrides):
    t = transformers
    torch.manual_seed(0)
    if kind == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(**COMMON, **overrides))
    if kind == "qwen3":
        return t.Qwen3ForCausalLM(t.Qwen3Config(**COMMON, head_dim=16, **overrides))
    raise ValueError(kind)


def ids(seed=1) -> torch.Tensor:
    return torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_upcycle_hf_keeps_logits(kind):
    model = hf_model(kind)
    ref = model(ids()).logits.detach()
    assert upcycle_hf(model, 4, 2) is model
    assert model.config.fp4stack_upcycled == {"n_experts": 4, "top_k": 2, "router_std": 0.02,
                                              "expert_noise": 0.0, "seed": 0, "split": False}
    assert all(isinstance(layer.mlp, MoEBlock) for layer in model.model.layers)
    names = dict(model.named_parameters())
    assert names["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 256, 64)
    assert names["model.layers.2.mlp.router.gate.weight"].shape == (4, 64)
    torch.testing.assert_close(model(ids()).logits, ref, rtol=1e-5, atol=1e-5)


def test_upcycle_hf_bf16_keeps_dtype():
    model = hf_model().to(torch.bfloat16)
    upcycle_hf(model, 4, 2)
    block = model.model.layers[0].mlp
    assert block.experts.gate_up_proj.dtype == block.router.gate.weight.dtype == torch.bfloat16
    assert torch.isfinite(model(ids()).logits).all()


def test_upcycled_hf_quantizes_and_trains():
    model = hf_model()
    upcycle_hf(model, 4, 2)
    summary = quantize_model(model, "qat-w")
    converted = dict(summary.converted)
    assert all(converted[f"model.layers.{i}.mlp.experts"] == "4 experts" for i in range(3))
    assert any("router" in n for n, _ in summary.skipped)
    out = model(ids(), labels=ids())
    aux = moe_aux_loss(model)
    assert aux is not None and aux.requires_grad
    (out.loss + 0.01 * aux).backward()
    for layer in model.model.layers:
        g = layer.mlp.router.gate.weight.grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
        e = layer.mlp.experts.gate_up_proj.grad
        assert e is not None and torch.isfinite(e).all()


def test_upcycled_hf_routing_record_and_replay():
    model = hf_model()
    upcycle_hf(model, 4, 2, expert_noise=0.05)  # distinct experts: the routing matters
    with record_routing(model) as routing:
        logits = model(ids()).logits
    assert sorted(routing) == [f"model.layers.{i}.mlp" for i in range(3)]
    assert all(r.shape == (2, 20, 2) for r in routing.values())
    with replay_routing(model, routing):
        assert torch.equal(model(ids()).logits, logits)
    other = {n: (r + 1) % 4 for n, r in routing.items()}
    with replay_routing(model, other):
        assert not torch.allclose(model(ids()).logits, logits)


def test_upcycle_hf_refusals():
    with pytest.raises(ValueError, match="hidden_act"):
        upcycle_hf(hf_model(hidden_act="gelu"), 4, 2)
    model = hf_model()
    upcycle_hf(model, 4, 2)
    with pytest.raises(ValueError, match="fp4stack_upcycled"):
        upcycle_hf(model, 4, 2)
    quantized = hf_model()
    quantize_model(quantized, "qat-w")
    with pytest.raises(ValueError, match="quantize_model"):
        upcycle_hf(quantized, 4, 2)
    assert not any(isinstance(m, MoEBlock) for m in quantized.modules())  # left as it was
    with pytest.raises(ValueError, match="top_k"):
        upcycle_hf(hf_model(), 2, 3)


def test_moe_aux_loss_sums_block_losses():
    moe = upcycle_gpt(dense(), 4, 2)
    assert moe_aux_loss(moe) is None
    moe(tokens())
    torch.testing.assert_close(moe_aux_loss(moe), moe.aux_loss)
    assert F.relu(moe.aux_loss - 3 * 2).item() == 0  # ~k per layer, far from collapse (k * E)


def test_split_upcycling_cuts_the_mlp_into_differing_experts():
    model = dense()  # ffn_hidden 128
    idx = tokens()
    ref = model(idx)[0]
    moe = upcycle_gpt(model, 4, 4, split=True, router_std=1e-6)
    assert (moe.config.moe_hidden, moe.config.n_experts) == (32, 4)
    # As many parameters as the dense model, plus the routers.
    routers = sum(b.mlp.router.gate.weight.numel() for b in moe.model.layers)
    assert sum(p.numel() for p in moe.parameters()) == sum(
        p.numel() for p in model.parameters()) + routers
    mlp, block = model.model.layers[0].mlp, moe.model.layers[0].mlp
    e1 = block.experts
    assert torch.equal(e1.gate_up_proj[1][:32], mlp.gate_proj.weight[32:64])
    assert torch.equal(e1.gate_up_proj[1][32:], mlp.up_proj.weight[32:64])
    assert torch.equal(e1.down_proj[1], mlp.down_proj.weight[:, 32:64] * 4)
    assert not torch.equal(e1.gate_up_proj[0], e1.gate_up_proj[1])  # experts differ
    # Every expert routed with near-uniform weights: the dense MLP again.
    torch.testing.assert_close(moe(idx)[0], ref, rtol=1e-4, atol=1e-4)
    # Two of four: another function, but one that runs and trains.
    two = upcycle_gpt(model, 4, 2, split=True)
    logits, loss = two(idx, idx)
    assert not torch.allclose(logits, ref, atol=1e-3) and torch.isfinite(loss)
    loss.backward()
    with pytest.raises(ValueError, match="n_experts=3 equal slices"):
        upcycle_gpt(model, 3, 1, split=True)
