"""Plot the weight flip and return rates of pretraining runs made with `--weight-flips`.

    python experiments/plot_weight_flips.py experiments/results/weight_flips_2026-12-01/* \
        --out docs/weight_flips.png

Each run directory holds the trainer's metrics.jsonl; the x axis is the fraction of training, so
runs of different lengths share it. Solid: flip rate; dashed: return rate (oscillation).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from plots import curves_axes, save_curves

from fp4stack.train import read_metrics


def flip_curves(run: Path) -> tuple[list[float], list[float], list[float]]:
    """(fraction of training, flip rate, return rate) of one run, from its logged records."""
    records = [r for r in read_metrics(run) if "weight_flip_rate" in r]
    if not records:
        raise SystemExit(f"{run}: no weight_flip_rate in metrics.jsonl (train with --weight-flips)")
    last = records[-1]["step"]
    return ([r["step"] / last for r in records], [r["weight_flip_rate"] for r in records],
            [r["weight_return_rate"] for r in records])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories with metrics.jsonl")
    p.add_argument("--out", default="weight_flips.png", help="PNG to write")
    args = p.parse_args(argv)
    fig, ax = curves_axes(2 * len(args.runs))
    for i, run in enumerate(args.runs):
        x, flips, returns = flip_curves(run)
        color = f"C{i}"
        ax.plot(x, flips, color=color, label=f"{run.name}: flips")
        ax.plot(x, returns, color=color, linestyle="--", label=f"{run.name}: returns")
    ax.set_yscale("log")
    save_curves(fig, ax, args.out, xlabel="fraction of training",
                ylabel="fraction of NVFP4 weights per step",
                title="NVFP4 weights that change value (flips) and change straight back (returns)")


if __name__ == "__main__":
    main()
