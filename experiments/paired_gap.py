"""Paired comparison of two recipes over seeds: same seed, same data order, so the per-seed
difference is free of the seed-to-seed noise that dominates single runs.

For each pair A:B and every seed with a finished run of both (run directories <recipe>-s<seed>
under the given comparison directories, as `fp4stack compare` writes them), prints the final
validation losses, A's relative difference to B in % at the end, the same for the mean
training loss over the last 100 steps, and a one-sided sign test (the chance that A ends worse
at this many seeds or more if the order of the two were a coin flip). With --plot, draws A's
difference to B at every evaluation: one line per pair, the mean over seeds, with the band
from the lowest to the highest seed.

    python experiments/paired_gap.py runs/compare/small-fs3 runs/compare/small-nvidia \\
        --pairs fullstack:fullstack-noreuse fullstack-nvidia:fullstack-nvidia-noreuse \\
        --plot docs/attention_reuse_paired_h200.png
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from plots import curves_axes, save_curves

from fp4stack.train.compare import seed_band
from fp4stack.train.metrics import read_metrics


def runs(dirs: list[Path]) -> dict[tuple[str, int], list[dict]]:
    """(recipe, seed) -> metrics of every finished run (a result.json) under `dirs`."""
    found = {}
    for d in dirs:
        for run in sorted(d.glob("*-s*")):
            recipe, _, seed = run.name.rpartition("-s")
            if seed.isdigit() and (run / "result.json").exists():
                found.setdefault((recipe, int(seed)), read_metrics(run))
    return found


def val_curve(metrics: list[dict]) -> dict[int, float]:
    return {m["step"]: m["val_loss"] for m in metrics if "val_loss" in m}


def late_train_loss(metrics: list[dict], window: int = 100) -> float:
    """Mean training loss over the last `window` steps (the logged ones)."""
    last = max(m["step"] for m in metrics if "loss" in m)
    return statistics.fmean(m["loss"] for m in metrics
                            if "loss" in m and m["step"] > last - window and not m.get("skipped"))


def sign_test(worse: int, n: int) -> float:
    """P(at least `worse` of n fair coin flips come up "worse")."""
    return sum(math.comb(n, k) for k in range(worse, n + 1)) / 2 ** n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", type=Path, help="comparison directories")
    p.add_argument("--pairs", nargs="+", required=True, help="A:B recipe pairs (A against B)")
    p.add_argument("--plot", type=Path, help="write the per-seed differences to this PNG")
    args = p.parse_args()
    found = runs(args.dirs)
    print("| A | B | seed | A final val | B final val | A vs B, val | A vs B, train (last 100) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    curves, summary = [], []
    for pair in args.pairs:
        a, sep, b = pair.partition(":")
        if not sep:
            raise SystemExit(f"--pairs takes A:B, got {pair!r}")
        seeds = sorted(s for (r, s) in found if r == a and (b, s) in found)
        if not seeds:
            raise SystemExit(f"no seed with finished runs of both {a} and {b} in {args.dirs}")
        diffs, per_seed = [], []
        for s in seeds:
            ma, mb = found[(a, s)], found[(b, s)]
            va, vb = val_curve(ma), val_curve(mb)
            steps = sorted(set(va) & set(vb))
            d_val = 100 * (va[steps[-1]] - vb[steps[-1]]) / vb[steps[-1]]
            ta, tb = late_train_loss(ma), late_train_loss(mb)
            diffs.append(d_val)
            print(f"| {a} | {b} | {s} | {va[steps[-1]]:.4f} | {vb[steps[-1]]:.4f} | "
                  f"{d_val:+.2f}% | {100 * (ta - tb) / tb:+.2f}% |")
            per_seed.append({t: (t, 100 * (va[t] - vb[t]) / vb[t]) for t in steps})
        worse = sum(d > 0 for d in diffs)
        curves.append((f"{a} vs {b} ({worse} of {len(diffs)} seeds worse)", seed_band(per_seed)))
        summary.append(f"{a} worse than {b} at {worse} of {len(diffs)} seeds (mean "
                       f"{statistics.fmean(diffs):+.2f}%); one-sided sign test p = "
                       f"{sign_test(worse, len(diffs)):.4f}")
    print("", *summary, sep="\n")
    if args.plot:
        fig, ax = curves_axes(len(curves))
        for index, (label, band) in enumerate(curves):
            steps, mean, lo, hi = zip(*((t, m, lo, hi) for t, (_, m, lo, hi) in band.items()),
                                      strict=True)
            ax.plot(steps, mean, marker="o", markersize=3, label=label, color=f"C{index % 10}")
            ax.fill_between(steps, lo, hi, color=f"C{index % 10}", alpha=0.12, linewidth=0)
        ax.axhline(0.0, color="black", linewidth=0.8)
        save_curves(fig, ax, args.plot, xlabel="step",
                    ylabel="validation loss, A relative to B (%)",
                    title="Paired by seed: mean and min..max over seeds; above 0, A is worse")


if __name__ == "__main__":
    main()
