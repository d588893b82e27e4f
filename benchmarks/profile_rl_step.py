"""Where one GRPO step's time goes: generation, scoring, the trainer's update, the mismatch
metrics and the refit, each timed with the device synchronized; then the trainer's update alone
under torch.profiler, per micro-batch size: wall against GPU kernel time, launches, host syncs
and peak memory.

The policy, engine and trainer are built as `fp4stack rl` builds them (`trainer.build_run`; the
SFT warm-up is cached in --cache). A trainer step whose kernels fill only part of its wall time
waits on the host, and a second run on the same GPU can use the rest; one whose kernels fill it
gains nothing from sharing the GPU. A larger micro-batch launches fewer kernels per token, at
the memory the table shows.

    python benchmarks/profile_rl_step.py --config configs/rl/smollm2-worked.yaml \\
        [--steps 3] [--micro-batch-sizes 64,128] [--cache runs/profile-rl] [--out profile.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from fp4stack.device import resolve_device
from fp4stack.kernels.profiling import short_name
from fp4stack.rl.config import load_rl_config
from fp4stack.rl.grpo_loss import group_advantages
from fp4stack.rl.metrics import mismatch_metrics
from fp4stack.rl.policies import encode_example
from fp4stack.rl.start import build_run, start_engine
from fp4stack.rl.trainer import draw_group, rollout_rewards
from fp4stack.rl.update import train_step

PHASES = ("generate", "score", "train", "metrics", "refit")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def _phase(times: dict[str, float], name: str, devices: tuple[torch.device, ...]):
    for d in devices:
        _sync(d)
    t0 = time.perf_counter()
    yield
    for d in devices:
        _sync(d)
    times[name] = time.perf_counter() - t0


def time_steps(cfg, parts, device: torch.device, steps: int):
    """`steps` GRPO steps after one untimed (compilation, graph capture), each phase timed;
    returns ([{phase: s}], the last step's rollout and advantages)."""
    devices = tuple({device, parts.engine_device})
    stream = parts.task.train_examples(cfg.seed)
    generator = torch.Generator(device=parts.engine_device).manual_seed(cfg.seed)
    rows = []
    for _ in range(steps + 1):
        group = draw_group(stream, cfg)
        prompts = [encode_example(parts.tokenizer, e.prompt)[0] for e in group]
        t: dict[str, float] = {}
        with _phase(t, "generate", devices):
            rollout = parts.engine.generate(prompts, generator,
                                            record=cfg.routing_replay).to(device)
        with _phase(t, "score", devices):
            rewards = rollout_rewards(parts.task, parts.tokenizer, rollout, group)
            adv = group_advantages(rewards, cfg.group_size)
        with _phase(t, "train", devices):
            logp, _, _ = train_step(parts.model, parts.opt, rollout, adv, cfg, parts.ref,
                                    forward=parts.step_model)
        with _phase(t, "metrics", devices):
            mismatch_metrics(logp, rollout.logprobs, rollout.response_mask)
        with _phase(t, "refit", devices):
            parts.engine.sync(parts.model)
        t["tokens"] = int(rollout.mask.sum())
        rows.append(t)
    return rows[1:], rollout, adv


def profile_train_step(cfg, parts, rollout, advantages, device: torch.device,
                       micro_batch_size: int, top: int) -> dict:
    """One trainer update (forward, backward, AdamW) over `rollout` in micro-batches of
    `micro_batch_size`: its synchronized wall time, then a second one under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    run_cfg = cfg.with_overrides(micro_batch_size=micro_batch_size)
    step = lambda: train_step(parts.model, parts.opt, rollout, advantages, run_cfg, parts.ref,  # noqa: E731
                              forward=parts.step_model)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t0 = time.perf_counter()
    step()
    _sync(device)
    wall = 1e3 * (time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        step()
        _sync(device)
    kernels: dict[str, list] = {}
    ops, syncs = 0, 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(short_name(e.name), [0, 0.0])
            k[0] += 1
            k[1] += e.device_time / 1e3
        else:
            ops += e.name.startswith("aten::")
            syncs += "Synchronize" in e.name
    gpu = sum(ms for _, ms in kernels.values())
    rows = sorted(((n, c, ms) for n, (c, ms) in kernels.items()), key=lambda r: -r[2])
    return {"micro_batch_size": micro_batch_size, "wall_ms": wall,
            "gpu_kernel_ms": gpu if device.type == "cuda" else None,
            "gpu_busy": gpu / wall if device.type == "cuda" else None,
            "launches": sum(c for c, _ in kernels.values()), "aten_calls": ops,
            "host_syncs": syncs, "peak_gib": peak, "kernels": rows[:top]}


def format_report(steps: list[dict], updates: list[dict]) -> str:
    med = {p: statistics.median(r[p] for r in steps) for p in (*PHASES, "tokens")}
    total = sum(med[p] for p in PHASES)
    lines = ["| phase | s per step (median) | share |", "|---|---:|---:|"]
    lines += [f"| {p} | {med[p]:.3f} | {100 * med[p] / total:.0f}% |" for p in PHASES]
    lines += [f"| step | {total:.3f} | {med['tokens']:.0f} tokens (prompts and responses) |", "",
              "| micro-batch | trainer update ms | GPU kernel ms | GPU busy | launches | aten calls"
              " | host syncs | peak GiB |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    dash = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for u in updates:
        lines.append(f"| {u['micro_batch_size']} | {u['wall_ms']:.1f} | "
                     f"{dash(u['gpu_kernel_ms'], '.1f')} | {dash(u['gpu_busy'], '.0%')} | "
                     f"{u['launches']} | {u['aten_calls']} | {u['host_syncs']} | "
                     f"{dash(u['peak_gib'], '.1f')} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="RL YAML (configs/rl/...)")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps timed after one untimed")
    p.add_argument("--micro-batch-sizes", default=None,
                   help="comma-separated trainer micro-batch sizes to profile (default: the "
                        "config's)")
    p.add_argument("--cache", default="runs/profile-rl", help="where the SFT warm-up is kept")
    p.add_argument("--device", default=None, help="auto, cpu, cuda (default: the config's)")
    p.add_argument("--top", type=int, default=12, help="kernels listed per micro-batch size")
    p.add_argument("--out", help="also write the results as JSON here")
    args = p.parse_args()
    if args.steps < 1:
        p.error("--steps must be >= 1")
    cfg = load_rl_config(args.config, device=args.device)
    sizes = ([int(s) for s in args.micro_batch_sizes.split(",")] if args.micro_batch_sizes
             else [cfg.micro_batch_size])
    device = resolve_device(cfg.device)
    parts = build_run(cfg, device, Path(args.cache))
    start_engine(cfg, parts)
    print(f"{cfg.rollout} rollout, {cfg.trainer} trainer ({cfg.trainer_dtype}) on {device}: "
          f"{cfg.prompts_per_step} prompts x {cfg.group_size} samples, up to "
          f"{cfg.max_new_tokens} new tokens", flush=True)
    steps, rollout, adv = time_steps(cfg, parts, device, args.steps)
    updates = [profile_train_step(cfg, parts, rollout, adv, device, m, args.top) for m in sizes]
    print(format_report(steps, updates))
    if args.out:
        meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__, "config": args.config,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="minutes")}
        Path(args.out).write_text(json.dumps({**meta, "steps": steps, "updates": updates},
                                             indent=1))


if __name__ == "__main__":
    main()
