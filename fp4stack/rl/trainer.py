"""The GRPO loop: sync -> rollout -> reward -> trainer log-probs -> mismatch metrics -> update.

One update per batch (on-policy), so the trainer's log-probs with gradients are also the "old"
log-probs (detached) of the PPO ratio, and the mismatch metrics compare them with the engine's.
DIR/metrics.jsonl gets one record per step; DIR/result.json the summary.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..convert import quantize_model
from ..data.tasks import Example, Task, load_task, pass_at_k
from ..device import resolve_device
from ..files import make_output_dir
from ..train import distributed
from ..train.determinism import deterministic_algorithms
from ..train.metrics import MetricsLogger
from ..train.run import compile_for_training
from . import policy as lm
from .config import ENGINE_PROCESS, RLConfig
from .fast_rollout import FastRolloutEngine, build_engine
from .grpo_loss import group_advantages
from .metrics import MismatchAlarm, activation_errors, mismatch_metrics
from .policies import (
    build_policy,
    calibration_sequences,
    encode_example,
    sft_warmup,
    weights_digest,
)
from .remote import ENGINE_RANK, TRAINER_RANK, RemoteEngine, serve
from .rollout import Rollout, RolloutEngine
from .schedule import RolloutSource
from .update import train_step

SFT_FILE = "sft_policy.pt"
# The RLConfig fields that determine the SFT warm-up's weights.
SFT_KEYS = ("policy", "upcycle", "task", "task_options", "seed", "sft_steps", "sft_lr",
            "sft_batch_size", "sft_recipe", "max_new_tokens")


def sft_inputs(cfg: RLConfig, vocab_size: int | None) -> dict[str, Any]:
    """Everything that determines the SFT warm-up's weights: its cache is reused only when these
    match (a comparison's runs differ in rollout and trainer only, so they share it)."""
    inputs = {k: getattr(cfg, k) for k in SFT_KEYS} | {"vocab_size": vocab_size}
    return json.loads(json.dumps(inputs, sort_keys=True, default=str))  # as stored: plain JSON


def _load_sft(cached: Path, inputs: dict[str, Any], device: torch.device
              ) -> tuple[dict[str, torch.Tensor] | None, str]:
    """The cached warm-up's weights when it was made from `inputs`, else (None, why not)."""
    stored = torch.load(cached, map_location=device, weights_only=True)
    if not (isinstance(stored, dict) and isinstance(stored.get("inputs"), str)):
        return None, "it records no inputs"
    made = json.loads(stored["inputs"])
    diff = [f"{k}: {made.get(k)!r} -> {inputs.get(k)!r}"
            for k in sorted(set(made) | set(inputs)) if made.get(k) != inputs.get(k)]
    return (None, "; ".join(diff)) if diff else (stored["state_dict"], "")


def prepare_policy(cfg: RLConfig, task: Task, device: torch.device, cache_dir: Path | None,
                   log=print) -> tuple[nn.Module, lm.TokenizerLike]:
    """The starting policy: built, upcycled, SFT-warmed (cached in cache_dir/sft_policy.pt with
    the inputs that made it, so every run of a comparison starts from the same weights and a run
    with other inputs redoes the warm-up)."""
    max_len = 64 + cfg.max_new_tokens
    model, tokenizer = build_policy(cfg.policy, cfg.upcycle, cfg.seed, max_len)
    model.to(device)
    if not cfg.sft_steps:
        return model.eval(), tokenizer
    inputs = sft_inputs(cfg, getattr(tokenizer, "vocab_size", None))
    cached = cache_dir / SFT_FILE if cache_dir is not None else None
    if cached is not None and cached.exists():
        weights, why = _load_sft(cached, inputs, device)
        if weights is not None:
            model.load_state_dict(weights)
            log(f"policy: loaded the SFT warm-up from {cached}")
            return model.eval(), tokenizer
        log(f"policy: {cached} does not match this run's SFT inputs ({why}); redoing the warm-up")
    # Deterministic algorithms, so that arms trained apart (in other processes, on other days)
    # start from the same weights: the start's digest in each result.json says whether they did.
    with deterministic_algorithms(warn_only=True):
        sft_warmup(model, tokenizer, task, steps=cfg.sft_steps, batch_size=cfg.sft_batch_size,
                   lr=cfg.sft_lr, seed=cfg.seed, device=device, recipe=cfg.sft_recipe, log=log)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f".{cached.name}.tmp")  # fixed: a killed save's is overwritten
        torch.save({"inputs": json.dumps(inputs), "state_dict": model.state_dict()}, tmp)
        os.replace(tmp, cached)
    return model.eval(), tokenizer


def evaluate(engine: RolloutEngine, task: Task, examples: list[Example]) -> float:
    """pass@1 with greedy decoding in the engine's precision."""
    prompts = [encode_example(engine.tokenizer, e.prompt)[0] for e in examples]
    saved = engine.temperature
    engine.temperature = 0.0
    try:
        rollout = engine.generate(prompts)
    finally:
        engine.temperature = saved
    texts = [engine.tokenizer.decode(r) for r in rollout.responses()]
    return sum(task.score(t, e) for t, e in zip(texts, examples, strict=True)) / len(examples)


def evaluate_pass_at_k(engine: RolloutEngine, task: Task, examples: list[Example], k: int,
                       generator: torch.Generator | None = None) -> float:
    """pass@k (unbiased estimator over n = 2k samples per problem at the sampling temperature;
    a sample passes when it scores 1)."""
    n = 2 * k
    prompts = [encode_example(engine.tokenizer, e.prompt)[0] for e in examples for _ in range(n)]
    texts = [engine.tokenizer.decode(r) for r in engine.generate(prompts, generator).responses()]
    total = 0.0
    for i, e in enumerate(examples):
        passed = sum(task.score(t, e) >= 1.0 for t in texts[i * n:(i + 1) * n])
        total += pass_at_k(n, passed, k)
    return total / len(examples)


def _activation_error(model, rollout, cfg: RLConfig, step: int, out: Path) -> dict[str, float]:
    """Per-layer W4A4 error of the trainer's policy on this step's rollouts, in the rollout's
    activation format (W4A4 with per-token scales for the -token rollouts, else per-tensor),
    appended to out/activation_error.jsonl; its means, for the step's metrics."""
    recipe = "w4a4-token" if cfg.rollout.endswith("-token") else "w4a4"
    summary, layers = activation_errors(model, rollout.tokens, rollout.mask, recipe,
                                        cfg.compensation)
    with open(out / "activation_error.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "recipe": recipe, "compensation": cfg.compensation,
                            **summary, "layers": layers}) + "\n")
    return summary


def warm_up_policy(cfg: RLConfig, cache_dir: str | os.PathLike) -> None:
    """Make the SFT start of `cfg` in cache_dir (or find it there), as `run_rl` would before its
    first step: runs started side by side then all load it."""
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)  # the state run_rl starts its warm-up from
    task = load_task(cfg.task, **cfg.task_options)
    prepare_policy(cfg, task, device, Path(cache_dir))


@dataclass
class RunParts:
    """What a GRPO run trains with: the task, the policy (the trainer's model) and its
    tokenizer, the rollout engine on its device, the optimizer, and the KL reference (or None)."""

    task: Task
    model: nn.Module
    tokenizer: lm.TokenizerLike
    engine: RolloutEngine | RemoteEngine
    engine_device: torch.device | str
    opt: torch.optim.Optimizer
    ref: nn.Module | None
    step_model: nn.Module | None = None  # what the update's forwards call: model, or compiled


def make_engine(cfg: RLConfig, base: nn.Module, tokenizer: lm.TokenizerLike,
                device: torch.device) -> RolloutEngine:
    """cfg's rollout engine on `device` (BF16 on CUDA), built from the unconverted `base`."""
    dtype = torch.bfloat16 if device.type == "cuda" else None
    return build_engine(cfg.engine, base, tokenizer, cfg.rollout, record=cfg.routing_replay,
                        temperature=cfg.temperature, top_p=cfg.top_p,
                        max_new_tokens=cfg.max_new_tokens, logprobs=cfg.logprobs,
                        compensation=cfg.compensation, compensation_mode=cfg.compensation_mode,
                        dtype=dtype, device=device)


def build_run(cfg: RLConfig, device: torch.device, cache_dir: Path | None, log=print
              ) -> RunParts:
    """cfg's task, SFT-warmed policy (cached in cache_dir), rollout engine (BF16 on CUDA; with
    engine_device "process" the handle on the engine process), trainer recipe, AdamW and KL
    reference, as `run_rl` starts from; the engine not yet refitted (`start_engine`)."""
    torch.manual_seed(cfg.seed)
    task = load_task(cfg.task, **cfg.task_options)
    base, tokenizer = prepare_policy(cfg, task, device, cache_dir, log)
    if cfg.engine_device == ENGINE_PROCESS:
        engine = RemoteEngine(tokenizer, device, temperature=cfg.temperature)
        engine_device = engine.device
    else:
        engine_device = (device if cfg.engine_device == "same"
                         else resolve_device(cfg.engine_device))
        engine = make_engine(cfg, base, tokenizer, engine_device)
    ref = None
    if cfg.kl_coef > 0:
        import copy

        ref = copy.deepcopy(base).eval().requires_grad_(False)
    model = base.train()
    if cfg.trainer != "bf16":
        quantize_model(model, cfg.trainer)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return RunParts(task, model, tokenizer, engine, engine_device, opt, ref,
                    compile_for_training(model, cfg.compile))


def serve_engine(cfg: RLConfig, device: torch.device, log=print) -> int:
    """The engine process of `engine_device: process` (rank 1): builds the policy's architecture
    (its weights come with the first refit), cfg's engine on `device`, and serves the trainer
    until it stops; returns the requests served."""
    torch.manual_seed(cfg.seed)
    base, tokenizer = build_policy(cfg.policy, cfg.upcycle, cfg.seed, 64 + cfg.max_new_tokens)
    engine = make_engine(cfg, base.to(device).eval(), tokenizer, device)
    del base
    kind = "fast" if isinstance(engine, FastRolloutEngine) else "reference"
    log(f"rl engine: {kind} {cfg.rollout} on {device}, serving the trainer (rank {TRAINER_RANK})")
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    return serve(engine, generator, kind)


def start_engine(cfg: RLConfig, parts: RunParts, log=print) -> None:
    """Refit the engine from the trainer's weights; with static compensation, fix its channels
    from calibration_size task examples."""
    engine = parts.engine
    engine.sync(parts.model)
    if (cfg.compensation_mode == "static" and engine.recipe is not None
            and engine.recipe.compensation is not None):
        n = engine.calibrate(calibration_sequences(parts.task, parts.tokenizer,
                                                   cfg.calibration_size, cfg.seed))
        log(f"rl: compensation channels fixed from {n} task examples (static mode)")


START_K3_HINT = 1.0  # k3 of the first step above which the start itself is the problem


def start_hint(cfg: RLConfig, first: dict[str, Any]) -> str | None:
    """A line for the log when the first step's k3 (`first`, its metrics) says the rollout
    engine's policy is another one than the trainer's from the start, as a small policy's
    NVFP4 copy of a BF16 warm-up can be (docs/results/rl.md); None otherwise."""
    if not first.get("k3", 0.0) > START_K3_HINT or cfg.sft_recipe != "bf16" or not cfg.sft_steps:
        return None
    return (f"the {cfg.rollout} engine's policy is far from the trainer's from the first step "
            f"(k3 {first['k3']:.3g}, per-token |dlogp| {first.get('logp_diff_mean', math.nan):.2f}"
            f" on average): this model may be too sensitive to {cfg.rollout} to start from a "
            "BF16 warm-up; a quantization-aware one (sft_recipe: nvfp4@forward or qat-w) "
            "starts the engine closer")


def draw_group(stream: Iterator[Example], cfg: RLConfig) -> list[Example]:
    """The next step's examples, one per row: each of prompts_per_step prompts group_size
    times."""
    return [e for e in (next(stream) for _ in range(cfg.prompts_per_step))
            for _ in range(cfg.group_size)]


def rollout_rewards(task: Task, tokenizer: lm.TokenizerLike, rollout: Rollout,
                    group: list[Example]) -> torch.Tensor:
    """Each row's reward [B], on the rollout's device: its decoded response scored against
    its example."""
    texts = [tokenizer.decode(r) for r in rollout.responses()]
    return torch.tensor([task.score(t, e) for t, e in zip(texts, group, strict=True)],
                        device=rollout.tokens.device)


def run_rl(cfg: RLConfig, log=print, cache_dir: str | os.PathLike | None = None
           ) -> dict[str, Any] | None:
    """Run GRPO as `cfg` says; returns the summary written to DIR/result.json.

    With engine_device "process", under `torchrun --nproc_per_node=2`, rank 0 trains and rank 1
    runs the rollout engine (`serve_engine`), each on its own device; rank 1 returns None."""
    if cfg.engine_device != ENGINE_PROCESS:
        return _run_rl(cfg, resolve_device(cfg.device), log, cache_dir)
    env = distributed.setup(cfg.device)
    try:
        if env.world_size != 2:
            raise ValueError(
                "engine_device: process runs the trainer and the rollout engine as the two "
                "processes of `torchrun --nproc_per_node=2 -m fp4stack.cli rl ...`; this run "
                f"has {env.world_size} process(es). For one process use engine_device: same "
                "(or a device name, e.g. cuda:1)")
        if env.rank == ENGINE_RANK:
            serve_engine(cfg, env.device, log)
            return None
        return _run_rl(cfg, env.device, log, cache_dir)
    finally:
        distributed.teardown(env)


def _run_rl(cfg: RLConfig, device: torch.device, log, cache_dir) -> dict[str, Any]:
    out = cfg.out_dir
    make_output_dir(out)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    parts = build_run(cfg, device, Path(cache_dir) if cache_dir else out, log)
    task, tokenizer, model, engine = parts.task, parts.tokenizer, parts.model, parts.engine
    engine_device, opt, ref = parts.engine_device, parts.opt, parts.ref
    remote = isinstance(engine, RemoteEngine)
    alarm = (MismatchAlarm("k3", cfg.alarm_k3, cfg.alarm) if cfg.alarm != "off" else None)
    logger = MetricsLogger(out, enabled=True, tensorboard=True)
    test = task.test_set()[:cfg.eval_size]
    stream = task.train_examples(cfg.seed)
    # The engine's sampling stream (an engine process draws from its own, seeded alike)
    generator = torch.Generator(device=device if remote else engine_device).manual_seed(cfg.seed)
    source = RolloutSource(
        engine, lambda: draw_group(stream, cfg),
        lambda e: encode_example(tokenizer, e.prompt)[0], generator, device,
        record=cfg.routing_replay, off_policy=cfg.off_policy)
    kind = (f"{engine.kind}, own process" if remote
            else "fast" if isinstance(engine, FastRolloutEngine) else "reference")
    log(f"rl: task {cfg.task}, rollout {cfg.rollout} (engine {kind} on {engine_device}"
        f"{', one step ahead' if cfg.off_policy else ''}), trainer {cfg.trainer} on {device}, "
        f"correction {cfg.correction}, {cfg.prompts_per_step} prompts x {cfg.group_size} "
        f"samples, {cfg.steps} steps"
        + ("" if cfg.compile is False else ", trainer forward through torch.compile")
        + f", out {out}")
    start_engine(cfg, parts, log)
    start_digest = weights_digest(model)
    log(f"rl: start weights {start_digest}")
    history = []
    pass1 = start_pass1 = evaluate(engine, task, test) if cfg.eval_every else None
    if pass1 is not None:
        logger.log({"step": 0, "pass_at_1": pass1})
        log(f"step 0: pass@1 {pass1:.3f}")
    start = time.perf_counter()
    step_s = 0.0
    try:
        for step in range(1, cfg.steps + 1):
            t0 = time.perf_counter()
            # The time limit is checked before the step, from the last step's duration, so the
            # run ends with a whole step and its final evaluation.
            last = step == cfg.steps or (
                cfg.max_minutes > 0 and t0 - start + step_s > 60 * cfg.max_minutes)
            batch = source.next(prefetch=not last)
            group, rollout = batch.group, batch.rollout
            rewards = rollout_rewards(task, tokenizer, rollout, group)
            adv = group_advantages(rewards, cfg.group_size)
            t_train = time.perf_counter()
            lp, entropy, stats = train_step(model, opt, rollout, adv, cfg, ref, log,
                                            forward=parts.step_model)
            if stats["micro_batch_size"] != cfg.micro_batch_size:  # what fits, from now on
                cfg = cfg.with_overrides(micro_batch_size=int(stats["micro_batch_size"]))
            mism = mismatch_metrics(lp, rollout.logprobs, rollout.response_mask)  # syncs
            t_sync = time.perf_counter()
            checked = source.sync(model)
            resp = rollout.response_mask
            record = {"step": step, "reward": rewards.mean().item(), **mism,
                      "entropy": float((entropy * resp).sum() / resp.sum().clamp(min=1)),
                      "response_len": rollout.response_lengths.float().mean().item(),
                      **{k: stats[k] for k in ("loss", "clip_frac", "grad_norm", "skipped",
                                               "micro_batch_size") if k in stats},
                      "synced_tensors": checked, "generate_s": batch.generate_s,
                      "rollout_wait_s": batch.wait_s, "train_s": t_sync - t_train,
                      "sync_s": time.perf_counter() - t_sync, "step_s": time.perf_counter() - t0}
            step_s = record["step_s"]
            if cfg.activation_error_every and (step % cfg.activation_error_every == 0 or last):
                record.update(_activation_error(model, rollout, cfg, step, out))
            if cfg.eval_every and (step % cfg.eval_every == 0 or last):
                record["pass_at_1"] = pass1 = evaluate(engine, task, test)
                if cfg.eval_pass_k > 1:
                    record[f"pass_at_{cfg.eval_pass_k}"] = evaluate_pass_at_k(
                        engine, task, test, cfg.eval_pass_k, generator)
            logger.log(record)
            history.append(record)
            log(f"step {step}/{cfg.steps} | reward {record['reward']:.3f} | k3 {record['k3']:.2e}"
                f" | |dlogp| max {record['logp_diff_max']:.3f} | len "
                f"{record['response_len']:.1f}" + (f" | pass@1 {record['pass_at_1']:.3f}"
                                                   if "pass_at_1" in record else ""))
            if step == 1 and (hint := start_hint(cfg, record)):
                log(f"rl: {hint}")
            if alarm is not None:
                with warnings.catch_warnings():  # logged here, in the run's own output
                    warnings.simplefilter("ignore")
                    message = alarm.check(step, record)
                if message:
                    log(f"alarm: {message}")
            if last:
                if step < cfg.steps:
                    log(f"time limit of {cfg.max_minutes:g} min: stopping after step {step}")
                break
    finally:
        source.close()
        logger.close()
        if remote:
            engine.close()
    k3 = [r["k3"] for r in history]
    result = {"rollout": cfg.rollout, "trainer": cfg.trainer, "trainer_dtype": cfg.trainer_dtype,
              "correction": cfg.correction,
              "compensation": cfg.compensation, "compensation_mode": cfg.compensation_mode,
              "seed": cfg.seed, "start_weights": start_digest,
              "engine_device": str(engine_device), "off_policy": cfg.off_policy,
              "steps": len(history), "final_reward": history[-1]["reward"],
              "start_pass_at_1": start_pass1,
              "final_pass_at_1": pass1, "k3_mean": sum(k3) / len(k3),
              "k3_median": statistics.median(k3), "k3_max": max(k3),
              "dlogp_max_mean": statistics.fmean(r["logp_diff_max"] for r in history),
              "dlogp_max_max": max(r["logp_diff_max"] for r in history),
              "dlogp_mean": statistics.fmean(r["logp_diff_mean"] for r in history),
              "step_s_median": statistics.median(r["step_s"] for r in history),
              "wall_s": time.perf_counter() - start, "device": str(device), "out": str(out)}
    if not all(math.isfinite(v) for v in k3):
        result["k3_nonfinite"] = True
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result
