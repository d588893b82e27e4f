"""Compare recipes fairly: same config, seed, data order and tokens; one run per recipe.

Writes DIR/compare.md (final validation loss, gap to BF16 in %, tokens/s), DIR/compare.json and
DIR/compare.png (validation and training loss curves against tokens).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from .. import finished_runs
from ..files import make_output_dir
from ..finished_runs import set_aside
from ..nn.recipe import recipe as get_recipe
from ..parallel_runs import LOG_NAME, Job, run_jobs
from .checkpoint import latest_checkpoint
from .config import PretrainConfig, load_config, recipe_arg
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
    # The final weights evaluated with every quantizer off (None for BF16, after a precision
    # switch, or from a run older than the field).
    val_loss_high_precision: float | None = None


def run_comparison(config: str | os.PathLike, recipes: list[str], out: str | os.PathLike, *,
                   seeds: tuple[int, ...] = (0,), baseline_seeds: tuple[int, ...] = (),
                   train_missing: bool = True, verbose: bool = False, jobs: int = 1,
                   **overrides) -> list[RunRow]:
    """Train every recipe at every seed in `seeds` (and BF16 at the extra `baseline_seeds`) from
    one config.

    A run is a recipe name, a YAML file holding a recipe mapping (fp4stack.nn.recipe_mapping;
    the run is named by the mapping's name), or either with "+optimizer" (e.g. "bf16+adamw4") to
    change the config's optimizer. Each run writes to out/<run>-s<seed>; a finished run (its
    result.json present) is reused and an interrupted one resumes from its last checkpoint, so
    an interrupted comparison picks up where it stopped; a run trained with another config (its
    config.json) is moved under out/.stale/ and trained again (finished_runs).
    train_missing=False reports on the finished runs only and trains nothing. verbose: each
    quantized run lists every module it converted or kept, not only the counts. jobs > 1 trains
    that many runs at once, each in its own process writing its output to <run>/run.log
    (`parallel_runs`).
    """
    if jobs < 1:
        raise ValueError(f"jobs (--jobs) must be >= 1, got {jobs}")
    out = Path(out)
    if not seeds:
        raise ValueError("seeds is empty; give at least one seed (e.g. --seeds 0)")
    plan = [(r, s) for r in recipes for s in seeds]
    plan += [(BASELINE, s) for s in baseline_seeds if s not in seeds or BASELINE not in recipes]
    runs = {entry: run_entry(entry) for entry in dict.fromkeys(r for r, _ in plan)}
    dirs = [(runs[entry][0], s, out / f"{runs[entry][0]}-s{s}") for entry, s in plan]
    pending = []
    for (entry, s), (label, _, run_dir) in zip(plan, dirs, strict=True):
        if not train_missing:
            continue
        _, recipe, optimizer = runs[entry]
        cfg = load_config(config, recipe=recipe, seed=s, out=str(run_dir), optimizer=optimizer,
                          **overrides)
        changed = stale_fields(run_dir, cfg)
        if changed:
            aside = set_aside(run_dir, out)
            print(f"{run_dir}: its run was trained with {', '.join(changed)}: trained again "
                  f"(the old run is now in {aside})", flush=True)
        if not (run_dir / "result.json").exists():
            pending.append(Job(f"{label}-s{s}", train, dict(
                cfg=cfg, resume=latest_checkpoint(run_dir) is not None, verbose=verbose),
                run_dir / LOG_NAME))
    if jobs > 1:
        run_jobs(pending, jobs)
    else:
        for job in pending:
            job.fn(**job.kwargs)
    rows = []
    for label, s, run_dir in dirs:
        done = run_dir / "result.json"
        if not done.exists():
            continue
        result = json.loads(done.read_text())
        rows.append(RunRow(label, s, float(result["final_val_loss"]),
                           float(result["tokens_per_s"]),
                           int(result["steps"]), str(run_dir),
                           result.get("final_val_loss_high_precision")))
    if not rows:
        raise FileNotFoundError(f"no finished runs in {out} (train_missing=False trains none)")
    write_report(rows, out)
    return rows


# Fields that change nothing a run computes (where it writes, what it logs, when it saves).
_NOT_COMPARED = ("out", "device", "log_every", "ckpt_every")


def stale_fields(run_dir: Path, cfg: PretrainConfig) -> list[str]:
    """The fields, as "name (saved -> now)", in which the run (finished or interrupted) in
    run_dir was trained with another value than cfg has; [] without its config.json."""
    return finished_runs.stale_fields(run_dir, cfg.to_dict(), PretrainConfig().to_dict(),
                                      _NOT_COMPARED)


def run_entry(entry: str) -> tuple[str, str | dict, str | None]:
    """(label, recipe, optimizer) of a run entry "recipe[+optimizer]", the recipe a preset name
    or a YAML file with a recipe mapping (`recipe_arg`), labelled by its name."""
    spec, _, optimizer = entry.partition("+")
    recipe = recipe_arg(spec)
    if isinstance(recipe, str):
        return entry, recipe, optimizer or None
    name = get_recipe(recipe).name
    return name + (f"+{optimizer}" if optimizer else ""), recipe, optimizer or None


def gaps(rows: list[RunRow]) -> dict[tuple[str, int], float | None]:
    """Gap of each run's final validation loss to the mean BF16 one, in %."""
    base = [r.val_loss for r in rows if r.recipe == BASELINE]
    if not base:
        return {(r.recipe, r.seed): None for r in rows}
    ref = statistics.fmean(base)
    return {(r.recipe, r.seed): 100.0 * (r.val_loss - ref) / ref for r in rows}


def format_table(rows: list[RunRow]) -> str:
    g = gaps(rows)
    base = [r.val_loss for r in rows if r.recipe == BASELINE]
    lines = ["| recipe | seed | final val loss | gap to BF16 | quantizers off (gap) | tokens/s |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in (r for runs in _by_recipe(rows).values() for r in runs):
        gap = g[(r.recipe, r.seed)]
        gap_s = "n/a" if gap is None else f"{gap:+.2f}%"
        hp = r.val_loss_high_precision
        hp_s = "-" if hp is None else f"{hp:.4f}" + (
            f" ({100.0 * (hp / statistics.fmean(base) - 1):+.2f}%)" if base else "")
        lines.append(f"| {r.recipe} | {r.seed} | {r.val_loss:.4f} | {gap_s} | {hp_s} | "
                     f"{r.tokens_per_s:,.0f} |")
    if len(base) > 1:
        spread = 100.0 * (max(base) - min(base)) / statistics.fmean(base)
        lines.append(f"\nBF16 seed-to-seed spread (noise floor): {spread:.2f}%")
    if any(len(v) > 1 for v in _by_recipe(rows).values()):
        lines += ["", format_summary(rows)]
    return "\n".join(lines)


def _by_recipe(rows: list[RunRow]) -> dict[str, list[RunRow]]:
    grouped: dict[str, list[RunRow]] = {}
    for r in rows:
        grouped.setdefault(r.recipe, []).append(r)
    return grouped


def gap_standard_error(runs: list[RunRow], base: list[RunRow]) -> float | None:
    """Standard error, in % of the BF16 mean, of the gap between the mean final validation
    losses of `runs` and of the BF16 runs `base`: both means are uncertain, and the runs are
    taken as independent (same-seed BF16 runs need not repeat on a GPU:
    docs/results/fullstack-gap.md). None with fewer than two runs on either side."""
    if len(runs) < 2 or len(base) < 2:
        return None
    a, b = [r.val_loss for r in runs], [r.val_loss for r in base]
    var = statistics.variance(a) / len(a) + statistics.variance(b) / len(b)
    return 100.0 * math.sqrt(var) / statistics.fmean(b)


def format_summary(rows: list[RunRow]) -> str:
    """One line per recipe: mean over its seeds of the final validation loss and of the gap,
    with the gap's standard error."""
    g = gaps(rows)
    base = [r for r in rows if r.recipe == BASELINE]
    lines = ["| recipe | seeds | mean val loss | mean gap to BF16 | s.e. | gap min..max |",
             "|---|---:|---:|---:|---:|---:|"]
    for recipe, runs in _by_recipe(rows).items():
        mean = statistics.fmean(r.val_loss for r in runs)
        rg = [g[(r.recipe, r.seed)] for r in runs]
        se = None if recipe == BASELINE else gap_standard_error(runs, base)
        se_s = "-" if se is None else f"{se:.2f}%"
        if None in rg:
            gap_s = span = "n/a"
        else:
            gap_s, span = f"{statistics.fmean(rg):+.2f}%", f"{min(rg):+.2f}..{max(rg):+.2f}%"
        lines.append(f"| {recipe} | {len(runs)} | {mean:.4f} | {gap_s} | {se_s} | {span} |")
    return "\n".join(lines)


def write_report(rows: list[RunRow], out: Path) -> None:
    make_output_dir(out)
    (out / "compare.md").write_text(format_table(rows) + "\n")
    (out / "compare.json").write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    with contextlib.suppress(ImportError):  # matplotlib is optional (fp4stack[analysis])
        plot_curves(rows, out / "compare.png")


def seed_band(curves: list[dict[int, tuple[float, float]]]
              ) -> dict[int, tuple[float, float, float, float]]:
    """step -> (tokens, mean, min, max) over seeds, at each step every curve has; a curve maps
    a step to (tokens, value)."""
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    band = {}
    for s in steps:
        ys = [c[s][1] for c in curves]
        band[s] = (statistics.fmean(c[s][0] for c in curves), statistics.fmean(ys),
                   min(ys), max(ys))
    return band


def plot_curves(rows: list[RunRow], path: Path) -> None:
    """Left: validation (markers) and training (thin) loss against tokens. Right: validation
    loss as a gap to the mean BF16 one at the same step, in %. One colour per recipe: with
    several seeds, the line is their mean and the shaded band spans their min..max (BF16's own
    band is the noise floor)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, gx) = plt.subplots(1, 2, figsize=(13, 5))
    metrics = {(r.recipe, r.seed): read_metrics(r.out) for r in rows}
    vals = {k: {m["step"]: (m["tokens"], m["val_loss"]) for m in ms if "val_loss" in m}
            for k, ms in metrics.items()}
    base = seed_band([vals[(r.recipe, r.seed)] for r in rows if r.recipe == BASELINE])
    base_mean = {s: mean for s, (_, mean, _, _) in base.items()}
    for i, (recipe, runs) in enumerate(_by_recipe(rows).items()):
        colour = f"C{i % 10}"
        label = (f"{recipe} (seed {runs[0].seed})" if len(runs) == 1
                 else f"{recipe} ({len(runs)} seeds)")
        train = seed_band([{m["step"]: (m["tokens"], m["loss"]) for m in metrics[(recipe, r.seed)]
                            if "loss" in m and not m.get("skipped")} for r in runs])
        if train:
            ax.plot([t for t, *_ in train.values()], [y for _, y, _, _ in train.values()],
                    color=colour, alpha=0.35, linewidth=0.8)
        val = seed_band([vals[(recipe, r.seed)] for r in runs])
        gap = {s: (t, *(100.0 * (y - base_mean[s]) / base_mean[s] for y in ys))
               for s, (t, *ys) in val.items() if s in base_mean}
        for a, band in ((ax, val), (gx, gap)):
            if not band:
                continue
            t, mean, lo, hi = zip(*band.values(), strict=True)
            a.plot(t, mean, marker="o", color=colour, label=label, markersize=3)
            if len(runs) > 1:
                a.fill_between(t, lo, hi, color=colour, alpha=0.15, linewidth=0)
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (thin: train, markers: validation)")
    ax.set_title("Pretraining loss by recipe (same data and tokens)")
    gx.axhline(0.0, color="black", linewidth=0.8)
    gx.set_xlabel("tokens")
    gx.set_ylabel("validation loss gap to mean BF16 (%)")
    gx.set_title("Gap to BF16 at each evaluation (band: min..max over seeds)")
    for a in (ax, gx):
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:  # no gap curves without a BF16 run
            a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
