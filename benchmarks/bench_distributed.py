"""Pretraining on several GPUs: scaling efficiency and the loss curve against one GPU.

For each recipe and wrapping (ddp, fsdp2, fsdp2-nvfp4: FSDP2 with NVFP4 all-gathers) it trains
the config for --steps steps on one process and under torchrun on each --nproc count, with the
same global batch, and reports tokens/s, its share per GPU against the one-GPU run (the scaling
efficiency), and how far each step's loss is from the one-GPU run's (relative). With the same
global batch every rank trains whole micro-batches of it, so the curves should agree to the fp32
sum order until a quantized value flips. Runs are written under --work (kept: each is an
ordinary run directory).

    python benchmarks/bench_distributed.py --config configs/pretrain/small.yaml \\
        --recipes bf16,nvfp4-nvidia --modes ddp,fsdp2,fsdp2-nvfp4 --nproc 2 --steps 60 \\
        --out benchmarks/results/bench_distributed.json --plot docs/distributed_small.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def command(config: str, recipe: str, mode: str, nproc: int, steps: int, out: Path,
            extra: list[str]) -> list[str]:
    """The pretrain command of one run: plain for one process, torchrun for more."""
    run = ["-m", "fp4stack.cli", "pretrain", "--config", config, "--recipe", recipe,
           "--max-steps", str(steps), "--out", str(out), *extra]
    if nproc == 1:
        return [sys.executable, *run]
    # "fsdp2-nvfp4": FSDP2 all-gathering the FP4 linear weights as NVFP4 bytes (fsdp_gather)
    wrapping = ["--distributed", "fsdp2", "--fsdp-gather", "nvfp4"] if mode == "fsdp2-nvfp4" \
        else ["--distributed", mode]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", *run, *wrapping]


def read_steps(out: Path) -> list[dict]:
    """The logged training steps of a finished run (metrics.jsonl)."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r and "tokens_per_s" in r]


def summarize(one: list[dict], many: list[dict], nproc: int, skip: int) -> dict:
    """Tokens/s (median over the steps after `skip`), per-GPU efficiency against `one`, and the
    largest relative loss difference per step."""
    def rate(steps: list[dict]) -> float:
        kept = steps[skip:] or steps
        return statistics.median(r["tokens_per_s"] for r in kept)

    if [r["step"] for r in one] != [r["step"] for r in many]:
        raise ValueError("the two runs logged different steps; use the same log_every")
    diffs = [abs(b["loss"] - a["loss"]) / abs(a["loss"]) for a, b in zip(one, many, strict=True)]
    base, got = rate(one), rate(many)
    return {"tokens_per_s": got, "tokens_per_s_one": base, "efficiency": got / nproc / base,
            "max_rel_loss_diff": max(diffs), "first_rel_loss_diff": diffs[0],
            "steps": [r["step"] for r in many], "loss": [r["loss"] for r in many],
            "loss_one": [r["loss"] for r in one]}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    shown = set()
    for r in rows:
        if r["recipe"] not in shown:
            ax.plot(r["steps"], r["loss_one"], label=f"{r['recipe']}, 1 GPU", lw=2)
            shown.add(r["recipe"])
        ax.plot(r["steps"], r["loss"], "--", label=f"{r['recipe']}, {r['nproc']} x {r['mode']}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/pretrain/small.yaml")
    p.add_argument("--recipes", default="bf16,nvfp4-nvidia")
    p.add_argument("--modes", default="ddp,fsdp2",
                   help="wrappings: ddp, fsdp2 (fp32 all-gathers), fsdp2-nvfp4 (NVFP4 ones)")
    p.add_argument("--nproc", default=None,
                   help="comma-separated process counts besides 1 (default: every visible GPU)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--skip", type=int, default=5, help="logged steps left out of tokens/s")
    p.add_argument("--work", default="runs/bench_distributed")
    p.add_argument("--extra", default="", help="more pretrain flags, e.g. '--compile'")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--plot", help="write the loss curves here (PNG)")
    args = p.parse_args()
    import torch

    counts = ([int(n) for n in args.nproc.split(",")] if args.nproc
              else [torch.cuda.device_count()])
    if any(n < 2 for n in counts):
        sys.exit("bench_distributed.py: --nproc counts must be >= 2 (1 is the baseline); with "
                 "fewer than two GPUs visible, pass --nproc (gloo on CPU: device cpu)")
    extra = args.extra.split()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    meta = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "gpus": torch.cuda.device_count(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "config": args.config, "steps": args.steps}
    rows = []

    def train(recipe: str, mode: str, nproc: int) -> list[dict]:
        out = Path(args.work) / f"{recipe}-{mode if nproc > 1 else 'one'}-{nproc}"
        cmd = command(args.config, recipe, mode, nproc, args.steps, out, extra)
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env=env)
        return read_steps(out)

    for recipe in args.recipes.split(","):
        one = train(recipe, "none", 1)
        for mode in args.modes.split(","):
            for n in counts:
                row = {"recipe": recipe, "mode": mode, "nproc": n,
                       **summarize(one, train(recipe, mode, n), n, args.skip)}
                rows.append(row)
                print(f"{recipe} {n} x {mode}: {row['tokens_per_s']:,.0f} tokens/s, "
                      f"efficiency {row['efficiency']:.1%}, max loss diff "
                      f"{row['max_rel_loss_diff']:.1e}", flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=1))
    print("| recipe | wrapping | GPUs | tokens/s | 1 GPU tokens/s | efficiency | max loss diff |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['recipe']} | {r['mode']} | {r['nproc']} | {r['tokens_per_s']:,.0f} | "
              f"{r['tokens_per_s_one']:,.0f} | {r['efficiency']:.1%} | "
              f"{r['max_rel_loss_diff']:.1e} |")
    if args.plot and rows:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
