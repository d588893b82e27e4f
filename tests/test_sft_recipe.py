"""The SFT warm-up under a training recipe (RLConfig.sft_recipe): a quantization-aware start."""

from __future__ import annotations

import copy

import pytest
import torch

from fp4stack.convert import quantize_model
from fp4stack.data.tasks import load_task
from fp4stack.nn.linear import QuantLinear
from fp4stack.rl import policy as lm
from fp4stack.rl.config import RLConfig
from fp4stack.rl.policies import build_policy, encode_example, sft_warmup
from fp4stack.rl.rollout import RolloutEngine
from fp4stack.rl.start import prepare_policy

CPU = torch.device("cpu")


def tiny(**overrides) -> RLConfig:
    base = dict(policy={"kind": "gpt", "preset": "tiny-moe", "moe_hidden": 64},
                task="arithmetic:add", task_options={"level": 1, "n_test": 25}, sft_steps=40,
                max_new_tokens=3, device="cpu")
    return RLConfig(**{**base, **overrides})


def start(cfg: RLConfig):
    torch.manual_seed(cfg.seed)
    return prepare_policy(cfg, load_task(cfg.task, **cfg.task_options), CPU, None,
                          lambda _: None)


def completion_nll(model, tokenizer, task, n: int = 64) -> float:
    """Mean negative log-prob of n held-out reference completions under `model`."""
    stream = task.train_examples(123_456)
    rows = [encode_example(tokenizer, e.prompt, task.completion(e))
            for e in (next(stream) for _ in range(n))]
    total, count = 0.0, 0
    with torch.no_grad():
        for p, c in rows:
            t = torch.tensor([p + c])
            lp = lm.token_logprobs(model, t, torch.ones_like(t, dtype=torch.bool))
            total -= lp[0, len(p):].sum().item()
            count += len(c)
    return total / count


def test_sft_recipe_is_checked_by_name():
    with pytest.raises(ValueError, match="sft_recipe must be one of"):
        tiny(sft_recipe="w4a4")  # an inference recipe: its packed weights cannot be trained


@pytest.mark.parametrize("recipe", ["qat-w", "nvfp4@forward"])
def test_the_warm_up_trains_a_converted_copy_and_keeps_the_plain_policy(recipe):
    cfg = tiny(sft_steps=3)
    model, tokenizer = build_policy(cfg.policy, cfg.upcycle, cfg.seed, 64)
    task = load_task(cfg.task, **cfg.task_options)
    kwargs = dict(steps=3, batch_size=8, lr=cfg.sft_lr, seed=0, device=CPU, log=lambda _: None)
    # By hand: the copy converted to the recipe, trained, its weights read back.
    by_hand = copy.deepcopy(model)
    quantize_model(by_hand, recipe)
    torch.manual_seed(1)
    expected_losses = sft_warmup(by_hand, tokenizer, task, **kwargs)
    plain = copy.deepcopy(model)
    torch.manual_seed(1)
    losses = sft_warmup(plain, tokenizer, task, recipe=recipe, **kwargs)
    assert losses == expected_losses
    assert not any(isinstance(m, QuantLinear) for m in plain.modules())
    got, want, before = plain.state_dict(), by_hand.state_dict(), model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert any(not torch.equal(got[k], before[k]) for k in before)  # it did train
    # The quantized forward is what trained: the BF16 warm-up's weights differ.
    bf16 = copy.deepcopy(model)
    torch.manual_seed(1)
    bf16_losses = sft_warmup(bf16, tokenizer, task, **kwargs)
    assert bf16_losses[0] != losses[0]


def test_a_quantization_aware_start_fits_its_quantized_rollout_better():
    # The reason for the option: the same warm-up under nvfp4@forward leaves a policy whose
    # W4A4 rollout engine scores the task's completions better than the BF16 warm-up's does.
    task = load_task("arithmetic:add", level=1, n_test=25)
    nll = {}
    for recipe in ("bf16", "nvfp4@forward"):
        model, tokenizer = start(tiny(sft_recipe=recipe))
        engine = RolloutEngine(model, tokenizer, "nvfp4")
        engine.sync(model)
        nll[recipe] = (completion_nll(model, tokenizer, task),  # (the policy, its engine)
                       completion_nll(engine.model, tokenizer, task))
    bf16_w4a4, qat_w4a4 = nll["bf16"][1], nll["nvfp4@forward"][1]
    assert qat_w4a4 < bf16_w4a4, nll


def test_a_far_start_names_the_quantization_aware_warm_up():
    from fp4stack.rl.start import start_hint

    cfg = tiny(rollout="nvfp4", trainer="bf16")
    hint = start_hint(cfg, {"k3": 430.0, "logp_diff_mean": 1.48})
    assert hint is not None and "k3 430" in hint and "sft_recipe: nvfp4@forward" in hint
    assert start_hint(cfg, {"k3": 0.07, "logp_diff_mean": 0.1}) is None  # a mismatch to measure
    assert start_hint(cfg, {"k3": float("nan")}) is None
    assert start_hint(cfg.with_overrides(sft_recipe="qat-w"), {"k3": 430.0}) is None
    assert start_hint(cfg.with_overrides(sft_steps=0), {"k3": 430.0}) is None  # no warm-up


def test_the_run_logs_the_hint_after_its_first_step(tmp_path, monkeypatch):
    import fp4stack.rl.start as start
    from fp4stack.rl.trainer import run_rl

    monkeypatch.setattr(start, "START_K3_HINT", -1.0)  # every first step counts as far here
    said = []
    run_rl(tiny(rollout="nvfp4", trainer="bf16", sft_steps=2, steps=2, eval_every=0,
                        prompts_per_step=2, group_size=2, out=str(tmp_path / "{rollout}")),
                   log=said.append)
    hints = [s for s in said if s.startswith("rl: the nvfp4 engine's policy is far")]
    assert len(hints) == 1, said
