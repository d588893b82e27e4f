"""Rollouts one step ahead (off_policy: 1) and the engine on its own device (engine_device).

On CPU both sides share the device; what is tested is the schedule: which weights sample which
step's rollouts, that the run is reproducible, and that the engine is refitted only while idle.
The CUDA tests run the same on the H200 (one GPU) and across two GPUs where there are two.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_rl import tiny_config as rl_config

from fp4stack.data.char_tokenizer import CharTokenizer
from fp4stack.models import GPT, GPTConfig
from fp4stack.rl.config import RLConfig
from fp4stack.rl.fast_rollout import build_engine
from fp4stack.rl.schedule import RolloutSource
from fp4stack.rl.trainer import run_rl
from fp4stack.train.metrics import read_metrics

TOK = CharTokenizer()
PROMPTS = [TOK.encode(p) for p in ("12+34=", "7+5=", "40+41=", "3+3=")]
CUDA = torch.cuda.is_available()


def policy(seed: int = 0, device: str = "cpu") -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.tiny_moe(vocab_size=TOK.vocab_size, max_seq_len=32)).to(device).eval()


def perturbed(model: GPT, seed: int) -> GPT:
    """model with every parameter moved a little, as an optimizer step would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.device, p.dtype))
    return model


def same(a, b) -> bool:
    return torch.equal(a.tokens.cpu(), b.tokens.cpu()) and torch.equal(
        a.logprobs.cpu(), b.logprobs.cpu())


def run_schedule(off_policy: int, engine_kind: str = "reference", device: str = "cpu",
                 engine_device: str = "cpu"):
    """Three steps of a source over a trainer whose weights change after each step; returns
    the rollouts handed out and the trainer's weights before each step."""
    trainer = policy(device=device)
    engine = build_engine(engine_kind, trainer, TOK, "nvfp4", max_new_tokens=4,
                          device=torch.device(engine_device))
    engine.sync(trainer)
    batches = iter([PROMPTS, PROMPTS[::-1], PROMPTS[1:]])
    source = RolloutSource(engine, lambda: next(batches), lambda p: p,
                           torch.Generator(device=engine_device).manual_seed(0),
                           torch.device(device), off_policy=off_policy)
    got, weights = [], []
    try:
        for step in range(3):
            weights.append({k: v.clone() for k, v in trainer.state_dict().items()})
            batch = source.next(prefetch=step < 2)
            assert batch.rollout.tokens.device.type == torch.device(device).type
            got.append(batch.rollout)
            perturbed(trainer, seed=step)  # the update of this step
            assert source.sync(trainer) > 0
    finally:
        source.close()
    return got, weights


def replay(weights, prompts, engine_kind="reference", engine_device="cpu"):
    """The rollouts one engine samples with the given weights per batch, one generator."""
    model = policy(device=engine_device)
    engine = build_engine(engine_kind, model, TOK, "nvfp4", max_new_tokens=4,
                          device=torch.device(engine_device))
    g = torch.Generator(device=engine_device).manual_seed(0)
    out = []
    for w, p in zip(weights, prompts, strict=True):
        model.load_state_dict(w)
        engine.sync(model)
        out.append(engine.generate(p, g))
    return out


BATCHES = [PROMPTS, PROMPTS[::-1], PROMPTS[1:]]


@pytest.mark.parametrize("off_policy", [0, 1])
def test_which_weights_sample_which_step(off_policy):
    """On-policy step s samples from the weights before step s; one step ahead, step s + 1's
    rollouts come from the weights before step s (the first two steps share the start)."""
    got, weights = run_schedule(off_policy)
    sampled_with = weights if off_policy == 0 else [weights[0], weights[0], weights[1]]
    want = replay(sampled_with, BATCHES)
    assert all(same(a, b) for a, b in zip(got, want, strict=True))
    # ...and not from the other schedule's weights (the test can tell the two apart).
    other = replay([weights[0], weights[0], weights[1]] if off_policy == 0 else weights, BATCHES)
    assert not same(got[2], other[2])


def test_a_failed_generation_surfaces_in_the_trainer():
    trainer = policy()
    engine = build_engine("reference", trainer, TOK, "nvfp4", max_new_tokens=4)
    engine.sync(trainer)
    batches = iter([PROMPTS, [[]]])  # an empty prompt: generate refuses it
    source = RolloutSource(engine, lambda: next(batches), lambda p: p, None,
                           torch.device("cpu"), off_policy=1)
    try:
        source.next()
        with pytest.raises(ValueError, match="non-empty prompts"):
            source.sync(trainer)
    finally:
        source.close()


def tiny_config(tmp_path, **overrides) -> RLConfig:
    return rl_config(tmp_path, **{"sft_steps": 2, "prompts_per_step": 4, "eval_every": 2,
                                  "eval_size": 8, **overrides})


def test_off_policy_run_is_reproducible_and_logs_its_timings(tmp_path):
    results = []
    for name in ("a", "b"):
        cfg = tiny_config(tmp_path / name, off_policy=1, engine_device="cpu",
                          correction="token-tis")
        results.append(run_rl(cfg, log=lambda *a: None))
    a, b = (read_metrics(tmp_path / n / "quads") for n in ("a", "b"))
    keys = ("reward", "k3", "logp_diff_max", "pass_at_1", "grad_norm")
    assert [[r.get(k) for k in keys] for r in a] == [[r.get(k) for k in keys] for r in b]
    steps = [r for r in a if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["generate_s"] > 0 and r["rollout_wait_s"] >= 0 for r in steps)
    assert results[0]["off_policy"] == 1 and results[0]["engine_device"] == "cpu"
    saved = json.loads((tmp_path / "a" / "quads" / "config.json").read_text())
    assert saved["off_policy"] == 1 and saved["engine_device"] == "cpu"


@pytest.mark.parametrize("bad,match", [({"off_policy": 2}, "off_policy"),
                                       ({"engine_device": 1}, "engine_device")])
def test_schedule_config_errors_name_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        RLConfig(**bad)


def test_an_engine_device_that_is_not_here_is_refused(tmp_path):
    cfg = tiny_config(tmp_path, engine_device="cuda:7" if CUDA else "cuda")
    with pytest.raises(ValueError, match="cuda"):
        run_rl(cfg, log=lambda *a: None)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_fast_engine_one_step_ahead_on_cuda():
    """The fast engine captures its decoding graph in the rollout thread while the trainer
    works (capture_error_mode thread_local) and samples what the schedule says, on one GPU or,
    where there are two, on the second."""
    engine_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    got, weights = run_schedule(1, "fast", "cuda:0", engine_device)
    want = replay([weights[0], weights[0], weights[1]], BATCHES, "fast", engine_device)
    assert all(same(a, b) for a, b in zip(got, want, strict=True))
