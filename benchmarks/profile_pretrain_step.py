"""Where one pretraining step's time goes, per recipe: wall time against GPU kernel time.

Builds the config's model and optimizer the way `fp4stack pretrain` does, runs --warmup steps,
times --steps synchronized steps (forward + backward over the micro-batches, gradient clipping,
the loss read back, the optimizer step), then profiles --steps more with torch.profiler. It
reports per step: wall ms, the GPU's kernel ms (kernels on one stream do not overlap, so their sum
is the time the GPU was busy), that busy share, kernel launches, host syncs, and the slowest
kernels and CPU ops. A busy share well under 1 means the step waits on the host (Python, launch
overhead, syncs), which a second run on the same GPU can fill. On CPU only the CPU ops are shown.

    python benchmarks/profile_pretrain_step.py --config configs/pretrain/small.yaml \\
        --recipes bf16,fullstack-nvidia-noreuse [--steps 5] [--out profile.json]
    python benchmarks/profile_pretrain_step.py --config configs/pretrain/tiny.yaml \\
        --recipes nvfp4 --vocab-size 4096 --device cpu      # random tokens, no data directory
    python benchmarks/profile_pretrain_step.py --config configs/pretrain/medium.yaml \\
        --recipes bf16,qat-w,nvfp4 --vocab-size 8192 --modes eager,compiled
    python benchmarks/profile_pretrain_step.py --config configs/pretrain/small-docs.yaml \\
        --recipes bf16,fullstack-nvidia-noreuse --vocab-size 8192 --modes compiled \\
        --micro-batch-size 64                 # one micro-batch a step: its peak memory
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections import defaultdict
from contextlib import nullcontext

import torch

from fp4stack.device import resolve_device
from fp4stack.kernels.profiling import short_name
from fp4stack.train.compare import run_entry
from fp4stack.train.config import load_config
from fp4stack.train.optimizers import build_from_config
from fp4stack.train.run import build_model, compile_for_training, open_data
from fp4stack.train.trainer import clip_gradients, forward_backward


def _batches(cfg, vocab_size: int | None, device: torch.device):
    """(vocab_size, batch(step) -> (x, y) on device): the data's, or random tokens."""
    if vocab_size is None:
        train, _ = open_data(cfg)

        def real(step):
            x, y = train.train_batch(step, cfg.global_batch_size, cfg.seq_len, seed=cfg.seed)
            return x.to(device), y.to(device)

        return train.vocab_size, real
    g = torch.Generator().manual_seed(cfg.seed)
    tokens = torch.randint(vocab_size, (cfg.global_batch_size, cfg.seq_len + 1), generator=g)
    return vocab_size, lambda step: (tokens[:, :-1].to(device), tokens[:, 1:].to(device))


# --modes: how the model's forward and backward run (PretrainConfig.compile's values).
MODES = {"eager": False, "compiled": True}


def _step_fn(cfg, vocab_size: int | None, device: torch.device, mode: str):
    vocab, batch = _batches(cfg, vocab_size, device)
    model, _ = build_model(cfg, vocab, device)
    opt = build_from_config(model, cfg, fused=device.type == "cuda")
    params = model.num_params()
    # As the trainer's compile: the model's forward (and backward) compiled, the rest eager.
    model = compile_for_training(model, MODES[mode])
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else nullcontext())
    count = [0]

    def step() -> float:
        x, y = batch(count[0])
        count[0] += 1
        loss = forward_backward(model, x, y, cfg.micro_batch_size, False, autocast)
        norm = clip_gradients(model, cfg.grad_clip)
        loss_value, _ = torch.stack((loss, norm.float())).tolist()  # the trainer's one sync
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss_value

    return step, params


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_recipe(cfg, vocab_size: int | None, device: torch.device, steps: int, warmup: int,
                   top: int, mode: str = "eager") -> dict:
    """Timings and the profile of `steps` training steps of cfg (after `warmup` steps), with
    the model eager or through torch.compile (`mode`, a MODES key; its compilation is timed
    apart, in warmup)."""
    from torch.profiler import ProfilerActivity, profile

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step, params = _step_fn(cfg, vocab_size, device, mode)
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    _sync(device)
    warmup_s = time.perf_counter() - t0
    walls = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        loss = step()
        _sync(device)
        walls.append(1e3 * (time.perf_counter() - t0))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    kernels, cpu_ops = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
    syncs = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[short_name(e.name)]
            k[0] += 1
            k[1] += e.device_time / 1e3
        else:
            c = cpu_ops[e.name]
            c[0] += 1
            c[1] += e.self_cpu_time_total / 1e3
            syncs += "Synchronize" in e.name
    per = lambda table: sorted(((n, c / steps, ms / steps) for n, (c, ms) in table.items()),  # noqa: E731
                               key=lambda r: -r[2])
    kernel_rows, cpu_rows = per(kernels), per(cpu_ops)
    wall = statistics.median(walls)
    gpu = sum(ms for _, _, ms in kernel_rows)
    return {
        "recipe": cfg.recipe, "mode": mode, "params": params,
        "loss": loss, "warmup_s": warmup_s,
        "tokens_per_step": cfg.global_batch_size * cfg.seq_len,
        "wall_ms": wall, "wall_ms_all": walls,
        "tokens_per_s": cfg.global_batch_size * cfg.seq_len / wall * 1e3,
        "gpu_kernel_ms": gpu if device.type == "cuda" else None,
        "gpu_busy": gpu / wall if device.type == "cuda" else None,
        "launches": sum(n for _, n, _ in kernel_rows),
        "host_syncs": syncs / steps,
        # what a micro-batch size fits: the most this recipe's model, states and steps held
        "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2**30
                            if device.type == "cuda" else None),
        "micro_batch_size": cfg.micro_batch_size,
        "kernels": kernel_rows[:top], "cpu_ops": cpu_rows[:top],
    }


def _table(rows, header: str) -> list[str]:
    out = [f"| {header} | per step | ms per step |", "|---|---:|---:|"]
    out += [f"| {name[:80]} | {n:g} | {ms:.3f} |" for name, n, ms in rows]
    return out


def format_report(results: list[dict]) -> str:
    bf16 = {r.get("mode", "eager"): r["wall_ms"] for r in results if r["recipe"] == "bf16"}
    lines = ["| recipe | mode | wall ms/step | vs bf16 (same mode) | GPU kernel ms/step | "
             "GPU busy | launches/step | host syncs/step | tokens/s | peak GiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        mode = r.get("mode", "eager")
        gpu = "-" if r["gpu_kernel_ms"] is None else f"{r['gpu_kernel_ms']:.1f}"
        busy = "-" if r["gpu_busy"] is None else f"{100 * r['gpu_busy']:.0f}%"
        ratio = f"{r['wall_ms'] / bf16[mode]:.2f}x" if mode in bf16 else "-"
        peak = r.get("peak_memory_gib")
        lines.append(f"| {r['recipe']} | {mode} | {r['wall_ms']:.1f} | {ratio} | {gpu} | {busy} | "
                     f"{r['launches']:g} | {r['host_syncs']:g} | {r['tokens_per_s']:,.0f} | "
                     f"{'-' if peak is None else f'{peak:.1f}'} |")
    for r in results:
        label = f"{r['recipe']} ({r.get('mode', 'eager')})"
        lines += ["", f"{label}: slowest kernels"] + _table(r["kernels"], "kernel")
        lines += ["", f"{label}: CPU ops by self time"] + _table(r["cpu_ops"], "op")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="pretraining YAML (configs/pretrain/...)")
    p.add_argument("--recipes", default="bf16,fullstack-nvidia-noreuse",
                   help="comma-separated recipe[+optimizer] entries as compare takes them, "
                   "profiled one after another in this process")
    p.add_argument("--steps", type=int, default=5, help="steps timed, then as many profiled")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation)")
    p.add_argument("--top", type=int, default=15, help="rows of the kernel and CPU-op tables")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="random tokens of this vocabulary instead of the config's data")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="sequences per forward (default: the config's); fewer micro-batches a "
                   "step means fewer launches, at the memory the peak GiB column shows")
    p.add_argument("--modes", default="eager",
                   help="comma-separated: eager, compiled (the model through torch.compile; "
                        "the trainer refuses CUDA-graph modes, see PretrainConfig.compile)")
    p.add_argument("--out", help="also write the results as JSON here (after every recipe)")
    args = p.parse_args()
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    modes = args.modes.split(",")
    if not modes or set(modes) - set(MODES):
        p.error(f"--modes takes some of {list(MODES)}, got {args.modes!r}")
    if set(modes) - {"eager"} and args.warmup < 1:
        p.error("compiled --modes need --warmup >= 1 (the compilation runs there)")
    device = resolve_device(args.device, local_rank=0)
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "config": args.config,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")}
    results = []
    for mode in modes:
        for name in args.recipes.split(","):
            label, recipe, optimizer = run_entry(name)  # "recipe[+optimizer]", as compare's
            cfg = load_config(args.config, recipe=recipe, optimizer=optimizer, device=args.device,
                              micro_batch_size=args.micro_batch_size)
            print(f"profiling {name} ({mode}) on {device} ...", flush=True)
            r = profile_recipe(cfg, args.vocab_size, device, args.steps, args.warmup, args.top,
                               mode=mode)
            r["recipe"] = label
            print(f"  {r['wall_ms']:.1f} ms/step, warmup {r['warmup_s']:.0f} s", flush=True)
            results.append(r)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({**meta, "results": results}, f, indent=1)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"{meta['device']}, torch {meta['torch']}, {meta['date']}")
    print(format_report(results))


if __name__ == "__main__":
    main()
