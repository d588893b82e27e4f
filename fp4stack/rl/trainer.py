"""The GRPO loop: sync -> rollout -> reward -> trainer log-probs -> mismatch metrics -> update.

One update per batch (on-policy), so the trainer's log-probs with gradients are also the "old"
log-probs (detached) of the PPO ratio, and the mismatch metrics compare them with the engine's.
DIR/metrics.jsonl gets one record per step; DIR/result.json the summary.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..data.tasks import Example, Task, pass_at_k
from ..device import resolve_device
from ..files import make_output_dir
from ..train import distributed
from ..train.metrics import MetricsLogger
from . import policy as lm
from .config import ENGINE_PROCESS, RLConfig
from .grpo_loss import group_advantages
from .metrics import MismatchAlarm, activation_errors, mismatch_metrics
from .policies import encode_example, weights_digest
from .remote import ENGINE_RANK, RemoteEngine
from .rollout import Rollout, RolloutEngine
from .schedule import RolloutSource
from .start import build_run, engine_kind, run_recipe, serve_engine, start_engine, start_hint
from .update import train_step


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
    recipe = run_recipe("w4a4-token" if cfg.rollout.endswith("-token") else "w4a4", cfg)
    summary, layers = activation_errors(model, rollout.tokens, rollout.mask, recipe,
                                        cfg.compensation)
    record = {"step": step, "recipe": recipe.name, "compensation": cfg.compensation,
              **summary, "layers": layers}
    with open(out / "activation_error.jsonl", "a") as f:
        f.write(json.dumps(_significant(record)) + "\n")
    return summary


def _significant(value: Any, digits: int = 6) -> Any:
    """value with every float cut to `digits` significant digits: the per-layer record is an
    analysis, and 17-digit floats made it ~1 MB a run."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: _significant(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [_significant(v, digits) for v in value]
    return value


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


ENGINE_WAIT = datetime.timedelta(hours=1)  # the longest an engine process waits for a message


def run_rl(cfg: RLConfig, log=print, cache_dir: str | os.PathLike | None = None
           ) -> dict[str, Any] | None:
    """Run GRPO as `cfg` says; returns the summary written to DIR/result.json.

    With engine_device "process", under `torchrun --nproc_per_node=2`, rank 0 trains and rank 1
    runs the rollout engine (`serve_engine`), each on its own device; rank 1 returns None."""
    if cfg.engine_device != ENGINE_PROCESS:
        return _run_rl(cfg, resolve_device(cfg.device), log, cache_dir)
    # The engine process waits for the trainer's first message through the SFT warm-up
    with distributed.process_group(cfg.device, timeout=ENGINE_WAIT) as env:
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
    kind = engine_kind(engine) + (", own process" if remote else "")
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
              "four_over_six": cfg.four_over_six, "seed": cfg.seed, "start_weights": start_digest,
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
