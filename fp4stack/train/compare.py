"""Compare recipes fairly: same config, seed, data order and tokens; one run per recipe.

Writes DIR/compare.md (final validation loss, gap to BF16 in %, tokens/s), DIR/compare.json and
DIR/compare.png (validation and training loss curves against tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from .config import load_config
from .metrics import read_metrics
from .trainer import train

BASELINE = "bf16"


@dataclass
class RunRow:
    recipe: str
    seed: int
    val_loss: float
    tokens_per_s: float
    steps: int
    out: str


def run_comparison(config: str | os.PathLike, recipes: list[str], out: str | os.PathLike, *,
                   seed: int = 0, baseline_seeds: tuple[int, ...] = (),
                   **overrides) -> list[RunRow]:
    """Train `recipes` (and the BF16 baseline at extra `baseline_seeds`) from one config.

    Each run writes to out/<recipe>-s<seed>; a finished run (its result.json present) is reused,
    so an interrupted comparison picks up where it stopped.
    """
    out = Path(out)
    plan = [(r, seed) for r in recipes] + [(BASELINE, s) for s in baseline_seeds if s != seed]
    rows = []
    for recipe, s in plan:
        run_dir = out / f"{recipe}-s{s}"
        done = run_dir / "result.json"
        if done.exists():
            result = json.loads(done.read_text())
        else:
            cfg = load_config(config, recipe=recipe, seed=s, out=str(run_dir), **overrides)
            result = train(cfg)
        rows.append(RunRow(recipe, s, float(result["final_val_loss"]),
                           float(result["tokens_per_s"]),
                           int(result["steps"]), str(run_dir)))
    write_report(rows, out)
    return rows


def gaps(rows: list[RunRow]) -> dict[tuple[str, int], float | None]:
    """Gap of each run's final validation loss to the mean BF16 one, in %."""
    base = [r.val_loss for r in rows if r.recipe == BASELINE]
    if not base:
        return {(r.recipe, r.seed): None for r in rows}
    ref = statistics.fmean(base)
    return {(r.recipe, r.seed): 100.0 * (r.val_loss - ref) / ref for r in rows}


def format_table(rows: list[RunRow]) -> str:
    g = gaps(rows)
    lines = ["| recipe | seed | final val loss | gap to BF16 | tokens/s |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        gap = g[(r.recipe, r.seed)]
        gap_s = "n/a" if gap is None else f"{gap:+.2f}%"
        lines.append(f"| {r.recipe} | {r.seed} | {r.val_loss:.4f} | {gap_s} | "
                     f"{r.tokens_per_s:,.0f} |")
    base = [r.val_loss for r in rows if r.recipe == BASELINE]
    if len(base) > 1:
        spread = 100.0 * (max(base) - min(base)) / statistics.fmean(base)
        lines.append(f"\nBF16 seed-to-seed spread (noise floor): {spread:.2f}%")
    return "\n".join(lines)


def write_report(rows: list[RunRow], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.md").write_text(format_table(rows) + "\n")
    (out / "compare.json").write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    with contextlib.suppress(ImportError):  # matplotlib is optional (fp4stack[analysis])
        plot_curves(rows, out / "compare.png")


def plot_curves(rows: list[RunRow], path: Path) -> None:
    """Validation (markers) and training (thin) loss against tokens, one colour per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, r in enumerate(rows):
        metrics = read_metrics(r.out)
        colour = f"C{i % 10}"
        train = [(m["tokens"], m["loss"]) for m in metrics if "loss" in m and not m.get("skipped")]
        val = [(m["tokens"], m["val_loss"]) for m in metrics if "val_loss" in m]
        label = f"{r.recipe} (seed {r.seed})"
        if train:
            ax.plot(*zip(*train, strict=True), color=colour, alpha=0.35, linewidth=0.8)
        if val:
            ax.plot(*zip(*val, strict=True), "o-", color=colour, label=label, markersize=3)
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (thin: train, markers: validation)")
    ax.set_title("Pretraining loss by recipe (same data, seed and tokens)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the `fp4stack compare` command ----------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML config shared by every run")
    p.add_argument("--recipes", default="bf16,nvfp4,nvfp4-nvidia,lowrank",
                   help="comma-separated recipes (default bf16,nvfp4,nvfp4-nvidia,lowrank)")
    p.add_argument("--seed", type=int, default=0, help="seed of every run (default 0)")
    p.add_argument("--baseline-seeds", default="",
                   help="extra BF16 seeds, comma-separated, to show the noise floor (e.g. 1)")
    p.add_argument("--out", default="runs/compare", help="output directory (default runs/compare)")
    p.add_argument("--max-steps", type=int, help="override the config's max_steps")
    p.add_argument("--data", help="override the config's data directory")
    p.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")


def run(args: argparse.Namespace) -> int:
    import sys

    recipes = [r for r in args.recipes.split(",") if r]
    seeds = tuple(int(s) for s in args.baseline_seeds.split(",") if s)
    try:
        rows = run_comparison(args.config, recipes, args.out, seed=args.seed,
                              baseline_seeds=seeds, max_steps=args.max_steps, data=args.data,
                              device=args.device)
    except (ValueError, FileNotFoundError) as e:
        print(f"fp4stack compare: error: {e}", file=sys.stderr)
        return 2
    print(format_table(rows))
    print(f"\nwritten: {Path(args.out) / 'compare.md'}, compare.json, compare.png")
    return 0
