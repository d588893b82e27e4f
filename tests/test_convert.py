"""quantize_model on fp4stack's GPT and on tiny random Hugging Face models, offline."""

from __future__ import annotations

import os

import pytest
import torch

import fp4stack
from fp4stack import QuantLinear
from fp4stack.convert import quantize_model
from fp4stack.nn.quant_experts import QuantExperts, QuantHFExperts

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def hf_model(kind: str):
    t = transformers
    torch.manual_seed(0)
    if kind == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(**COMMON))
    if kind == "qwen3-moe":
        return t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(
            **COMMON, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=16))
    if kind == "olmoe":
        return t.OlmoeForCausalLM(t.OlmoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2))
    if kind == "mixtral":
        return t.MixtralForCausalLM(t.MixtralConfig(**COMMON, num_local_experts=4,
                                                    num_experts_per_tok=2))
    raise ValueError(kind)


HF = ["llama", "qwen3-moe", "olmoe", "mixtral"]


@pytest.mark.parametrize("kind", HF)
@pytest.mark.parametrize("name", ["qat-w", "nvfp4", "w4a4"])
def test_hf_models_convert_and_run(kind, name):
    model = hf_model(kind)
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    ref = model(ids).logits.detach()
    summary = quantize_model(model, name)
    converted = dict(summary.converted)
    skipped = dict(summary.skipped)
    assert "lm_head" in skipped and "model.embed_tokens" in skipped
    assert all(isinstance(model.get_submodule(n), (QuantLinear, QuantExperts, QuantHFExperts))
               for n in converted)
    if kind != "llama":
        assert any("experts" in n for n in converted)
        assert any("router" in reason for reason in skipped.values())
    out = model(ids, labels=ids)
    rel = float((out.logits.detach() - ref).norm() / ref.norm())
    assert 0 < rel < 0.5  # quantized, and still the same function roughly
    if name != "w4a4":
        out.loss.backward()
        grads = [p.grad for n, p in model.named_parameters() if "proj" in n]
        assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_qkv_and_gate_up_share_one_global_amax():
    model = hf_model("llama")
    summary = quantize_model(model, "w4a4")
    attn = model.model.layers[0].self_attn
    amaxes = {float(getattr(attn, p).packed_weight.amax) for p in ("q_proj", "k_proj", "v_proj")}
    assert len(amaxes) == 1
    assert ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"] in summary.shared_amax


def test_shared_amax_follows_training_weights():
    model = hf_model("llama")
    quantize_model(model, "qat-w")
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.k_proj.weight.mul_(10)
    shared = attn.q_proj.shared_weight_amax()
    assert float(shared) == float(attn.k_proj.weight.detach().abs().max())


def test_keep_first_and_last_blocks():
    model = hf_model("llama")
    summary = quantize_model(model, "nvfp4-nvidia")
    converted = [n for n, _ in summary.converted]
    assert converted and all(".layers.1." in n for n in converted)
    reasons = dict(summary.skipped)
    assert "first 1" in reasons["model.layers.0.self_attn.q_proj"]
    assert "last 1" in reasons["model.layers.2.mlp.down_proj"]
    assert "converted" in str(summary) and "skipped" in str(summary)


def test_bf16_recipe_converts_nothing():
    model = hf_model("llama")
    summary = quantize_model(model, "bf16")
    assert not summary.converted and "quantizes nothing" in summary.skipped[0][1]


def test_gpt_dense_and_moe():
    from fp4stack.models import GPT, GPTConfig

    for cfg in (GPTConfig.tiny(), GPTConfig.tiny_moe()):
        torch.manual_seed(0)
        model = GPT(cfg)
        idx = torch.randint(0, cfg.vocab_size, (2, 16))
        summary = quantize_model(model, "nvfp4")
        kinds = {k for _, k in summary.converted}
        assert "linear" in kinds
        if cfg.moe:
            assert any("experts" in k for k in kinds)
            assert any("router" in n for n, _ in summary.skipped)
        _, loss = model(idx, idx)
        loss.backward()
        assert torch.isfinite(loss)


def test_moe_trainer_and_rollout_experts_agree_bit_for_bit():
    # qat-w (trainer) and w4a4 (rollout) see the same expert weights.
    trainer, rollout = hf_model("qwen3-moe"), hf_model("qwen3-moe")
    quantize_model(trainer, "qat-w")
    quantize_model(rollout, "w4a4")
    t = trainer.model.layers[0].mlp.experts
    r = rollout.model.layers[0].mlp.experts
    for e in range(4):
        w = fp4stack.fake_quantize(t.gate_up_proj[e].detach(), spec=t.recipe.w)
        assert torch.equal(w, fp4stack.dequantize(r.packed_expert("gate_up", e)))


def test_calibration_sets_static_activation_amax_and_channels():
    from fp4stack.convert import calibrate
    from fp4stack.nn import ResidualCompensation

    model = hf_model("llama")
    rec = fp4stack.recipe("w4a4-rc").with_(
        activation_amax="static", compensation=ResidualCompensation(k=4, mode="static"))
    quantize_model(model, rec)
    batches = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(s))
               for s in range(3)]
    assert calibrate(model, batches) == 3
    q = model.model.layers[0].self_attn.q_proj
    assert q.x_amax is not None and float(q.x_amax) > 0
    assert q.rc_channels.shape == (4,)
    out = model(batches[0]).logits
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="no QuantLinear"):
        calibrate(hf_model("llama"), batches)


def test_fullstack_recipe_swaps_attention_outside_the_kept_blocks():
    from fp4stack.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layers=3))
    plain = GPT(GPTConfig.tiny(n_layers=3))
    plain.load_state_dict(model.state_dict())
    recipe = fp4stack.recipe("fullstack").with_(keep_last_blocks=1, lowrank=None)
    summary = fp4stack.quantize_model(model, recipe)
    swapped = [n for n, kind in summary.converted if kind == "fp4 attention"]
    assert swapped == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert any(n == "model.layers.2.self_attn" for n, _ in summary.skipped)
    x = torch.randint(0, 256, (2, 32))
    logits, _ = model(x)
    assert torch.isfinite(logits).all()
    # Only the attention differs between this and the same recipe without FP4 attention.
    fp4stack.quantize_model(plain, recipe.with_(attention=None))
    assert not torch.equal(plain(x)[0], logits)


@pytest.mark.parametrize("recipe", [
    "fullstack", "nvfp4-nvidia", fp4stack.recipe("w4a4-rc").with_(weight_storage="master")],
    ids=["fullstack", "nvfp4-nvidia", "w4a4-rc-master"])
def test_to_high_precision_computes_what_the_unquantized_model_does(recipe):
    from fp4stack.convert import to_high_precision
    from fp4stack.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layers=3))
    plain = GPT(GPTConfig.tiny(n_layers=3))
    plain.load_state_dict(model.state_dict())
    summary = fp4stack.quantize_model(model, recipe)
    x = torch.randint(0, 256, (2, 32))
    assert not torch.equal(model(x, x)[1], plain(x, x)[1])
    assert to_high_precision(model) == len(summary.converted)
    logits, loss = model(x, x)
    ref_logits, ref_loss = plain(x, x)
    assert torch.equal(logits, ref_logits)
    loss.backward()
    ref_loss.backward()
    grads = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        if name in grads:  # the low-rank factors are buffers; every parameter has a twin
            assert torch.equal(p.grad, grads[name].grad), name
    for m in model.modules():
        if isinstance(m, QuantLinear):
            assert not m.recipe.quantizes and m.recipe.lowrank is None
            assert m.recipe.name == f"{fp4stack.recipe(recipe).name}+bf16"
    assert to_high_precision(model) == 0  # a second switch finds nothing left to switch


def test_to_high_precision_keeps_a_trained_lowrank_branch_and_refuses_packed_weights():
    from fp4stack.convert import to_high_precision
    from fp4stack.nn.recipe import LowRank

    model = hf_model("llama")
    fp4stack.quantize_model(model, fp4stack.recipe("lowrank").with_(
        lowrank=LowRank(rank=4, trainable=True)))
    to_high_precision(model)
    q = model.model.layers[0].self_attn.q_proj
    assert not q.recipe.quantizes and q.recipe.lowrank == LowRank(rank=4, trainable=True)
    x = torch.randn(3, q.in_features)
    branch = (x @ q.lowrank_a.t()) @ q.lowrank_b.t()
    torch.testing.assert_close(q(x), torch.nn.functional.linear(x, q.weight) + branch,
                               rtol=0, atol=0)

    # One packed layer late in the model: the error comes before any earlier layer switches.
    mixed = hf_model("llama")
    fp4stack.quantize_model(mixed, "nvfp4")
    mixed.model.layers[2].mlp.down_proj = QuantLinear.from_linear(
        torch.nn.Linear(128, 64, bias=False), "w4a4")
    recipes = [m.recipe for m in mixed.modules() if isinstance(m, QuantLinear)]
    with pytest.raises(ValueError, match="down_proj: packed NVFP4 weights keep no master"):
        to_high_precision(mixed)
    assert [m.recipe for m in mixed.modules() if isinstance(m, QuantLinear)] == recipes


@pytest.mark.parametrize("recipe", ["fullstack", "lowrank"])
def test_high_precision_switches_for_the_block_only(recipe):
    from fp4stack.convert import high_precision
    from fp4stack.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layers=3))
    plain = GPT(GPTConfig.tiny(n_layers=3))
    plain.load_state_dict(model.state_dict())
    fp4stack.quantize_model(model, recipe)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randint(0, 256, (2, 32))
    before = model(x)[0]
    with high_precision(model) as n:
        assert n > 0
        assert torch.equal(model(x)[0], plain(x)[0])
    assert torch.equal(model(x)[0], before)
    after = model.state_dict()
    # Only the low-rank refresh counters move: by the two training forwards outside the block.
    counters = {k for k in state if k.endswith(".lowrank_forwards")}
    assert counters and after.keys() == state.keys()
    assert all(torch.equal(after[k], state[k]) for k in state.keys() - counters)
    assert all(int(after[k]) == int(state[k]) + 2 for k in counters)
    with high_precision(plain) as n:  # nothing to switch in an unquantized model
        assert n == 0


def test_the_short_summary_counts_what_the_full_one_lists():
    from fp4stack.models import GPT, GPTConfig

    summary = quantize_model(GPT(GPTConfig.tiny()), "fullstack")
    n_linears = sum(kind == "linear" for _, kind in summary.converted)
    assert summary.short() == (
        f"quantize_model: recipe fullstack: converted {n_linears} linears, 2 blocks' attention "
        "in FP4; kept 2 in high precision (model.embed_tokens, lm_head); 4 shared-amax groups")
    assert "\n" not in summary.short() and len(str(summary).splitlines()) > 10
    bf16 = quantize_model(GPT(GPTConfig.tiny()), "bf16").short()
    assert bf16 == "quantize_model: recipe bf16: converted nothing; recipe 'bf16' quantizes nothing"
