"""The report of an RL comparison: a row per run, a row per run over its seeds, a plot per step.

`rl-compare` writes it for the runs it trained. `rl-compare --report-from DIR,...` writes it for
finished runs found under several directories, e.g. the arms of one comparison trained in
different sessions or on different machines: each run is named from its result.json and
config.json (`run_name`, plus the config fields in which it differs from the other runs), and
runs of one seed that do not start from the same weights are flagged, since they are not one
comparison.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .. import finished_runs
from ..files import make_output_dir
from ..finished_runs import STALE_DIR
from ..train.metrics import read_metrics
from .config import RUN_FIELDS, RLConfig, default_trainer

RESULT_FILE = "result.json"
# Config fields that a run's name states, that every run of a comparison differs in, that only
# say when a run stops (its steps are in the table), or how the same update is computed
# (micro-batches change only the order of the gradient's sums).
_NAMED = (*RUN_FIELDS, "steps", "max_minutes", "micro_batch_size")


def _num(v: float | None, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def format_table(rows: list[dict[str, Any]]) -> str:
    """A markdown row per run and seed."""
    # The median beside the mean: one spiking step can carry a run's mean k3. The per-step
    # max |dlogp| is the QUADS paper's measure of the mismatch.
    lines = ["| run | seed | rollout | trainer | start pass@1 | final pass@1 | final reward | "
             "mean k3 | median k3 | max k3 | mean max abs dlogp | mean abs dlogp |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['run']} | {r.get('seed', '')} | {r['rollout']} | {r['trainer']} | "
            f"{_num(r.get('start_pass_at_1'), '.3f')} | {_num(r.get('final_pass_at_1'), '.3f')}"
            f" | {r['final_reward']:.3f} | {r['k3_mean']:.2e} | "
            f"{_num(r.get('k3_median'), '.2e')} | {r['k3_max']:.2e} | "
            f"{_num(r.get('dlogp_max_mean'), '.3f')} | {_num(r.get('dlogp_mean'), '.4f')} |")
    return "\n".join(lines)


def _mean_sd(values: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def seed_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A row per run over its seeds: the mean (and sample standard deviation) of the final
    pass@1 and of its change from the start, and the means of k3 and of the per-step max
    |dlogp|. Runs without pass@1 (eval_every 0) have None there."""
    out = []
    for name in dict.fromkeys(r["run"] for r in rows):
        own = [r for r in rows if r["run"] == name]
        evaluated = [r for r in own if r.get("final_pass_at_1") is not None]
        row: dict[str, Any] = {"run": name, "seeds": len(own),
                               "steps": min(r["steps"] for r in own)}
        row["pass_at_1"], row["pass_at_1_sd"] = (
            _mean_sd([r["final_pass_at_1"] for r in evaluated]) if evaluated else (None, None))
        row["pass_at_1_gain"] = (statistics.fmean(
            r["final_pass_at_1"] - r["start_pass_at_1"] for r in evaluated) if evaluated else None)
        row["k3_mean"] = statistics.fmean(r["k3_mean"] for r in own)
        row["dlogp_max_mean"] = (statistics.fmean(r["dlogp_max_mean"] for r in own)
                                 if all("dlogp_max_mean" in r for r in own) else None)
        out.append(row)
    return out


def format_seed_table(summary: list[dict[str, Any]]) -> str:
    """The seed_summary as a markdown table."""
    lines = ["| run | seeds | steps | final pass@1 (mean) | sd | change from start | mean k3 | "
             "mean max abs dlogp |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summary:
        lines.append(
            f"| {s['run']} | {s['seeds']} | {s['steps']} | {_num(s['pass_at_1'], '.3f')} | "
            f"{_num(s['pass_at_1_sd'], '.3f')} | {_num(s['pass_at_1_gain'], '+.3f')} | "
            f"{s['k3_mean']:.2e} | {_num(s['dlogp_max_mean'], '.3f')} |")
    return "\n".join(lines)


def start_conflicts(rows: list[dict[str, Any]]) -> list[str]:
    """A sentence per seed whose runs start from different weights (their `start_weights`
    digests differ): such runs are not one comparison."""
    said = []
    for seed in dict.fromkeys(r.get("seed") for r in rows):
        starts: dict[str, list[str]] = {}
        for r in rows:
            if r.get("seed") == seed and r.get("start_weights"):
                starts.setdefault(r["start_weights"], []).append(r["run"])
        if len(starts) > 1:
            said.append(f"seed {seed}: the runs start from {len(starts)} different weights (" +
                        "; ".join(f"{d}: {', '.join(runs)}" for d, runs in starts.items()) + ")")
    return said


def write_report(rows: list[dict[str, Any]], out: Path) -> None:
    """DIR/rl_compare.md (the tables, and any start conflicts), rl_compare.json (the rows) and,
    with matplotlib installed, rl_compare.png."""
    make_output_dir(out)
    text = format_table(rows) + "\n"
    if len(rows) > len({r["run"] for r in rows}):  # some run has several seeds
        text += "\nOver the seeds:\n\n" + format_seed_table(seed_summary(rows)) + "\n"
    conflicts = start_conflicts(rows)
    if conflicts:
        text += "\nNot one start: " + "; ".join(conflicts) + ".\n"
    (out / "rl_compare.md").write_text(text)
    (out / "rl_compare.json").write_text(json.dumps(rows, indent=1))
    with contextlib.suppress(ImportError):  # matplotlib is optional
        plot(rows, out / "rl_compare.png")


def run_name(result: dict[str, Any]) -> str:
    """The `rl-compare` name of a finished run (compare.parse_run's inverse) from its
    result.json: e.g. bf16, nvfp4+tis, quads@0.5:static, nvfp4/qat-w. A quads run always
    names its channel mode, so a label does not depend on the default of the day (runs from
    before the mode existed were dynamic)."""
    rollout = result["rollout"]
    name = rollout
    if rollout.startswith("quads"):
        name += f"@{result['compensation']:g}:{result.get('compensation_mode', 'dynamic')}"
    if result["trainer"] != default_trainer(rollout):
        name += "/" + result["trainer"]
    if result.get("correction") == "token-tis":
        name += "+tis"
    return name


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RLConfig)
             if f.default is not dataclasses.MISSING}
# Defaults that have changed: a config.json without the field was written under the old one.
_FORMER_DEFAULTS = {"compensation": 0.05, "compensation_mode": "dynamic"}  # until 2026-12-07
# What a config.json leaves out was at these values when it was written.
SAVED_DEFAULTS = {**_DEFAULTS, **_FORMER_DEFAULTS}


def saved_config(run_dir: Path) -> dict[str, Any]:
    """The config a finished run in run_dir was trained with, every field filled in (one its
    version of fp4stack did not have is at the default of the time); {} without config.json."""
    return finished_runs.saved_config(run_dir, SAVED_DEFAULTS)


def _scalar(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool)) or v is None


def collect_rows(dirs: Iterable[str | Path]) -> list[dict[str, Any]]:
    """A row per finished run (a directory with result.json) under `dirs`, named by `run_name`
    plus each scalar config field in which the runs differ (as a sweep names them: "bf16
    lr=2e-06"), its "out" the directory where it was found. FileNotFoundError when none is."""
    found = []
    for d in dirs:
        if not Path(d).is_dir():
            raise FileNotFoundError(f"report: {d} is not a directory")
        for path in sorted(Path(d).rglob(RESULT_FILE)):
            if STALE_DIR in path.relative_to(d).parts:
                continue
            found.append((json.loads(path.read_text()), saved_config(path.parent), path.parent))
    if not found:
        raise FileNotFoundError(f"report: no finished run ({RESULT_FILE}) under "
                                f"{', '.join(map(str, dirs))}")
    keys = dict.fromkeys(k for _, cfg, _ in found for k, v in cfg.items()
                         if k not in _NAMED and _scalar(v))
    varying = [k for k in keys if len({json.dumps(cfg.get(k)) for _, cfg, _ in found}) > 1]
    rows = []
    for result, cfg, where in found:
        label = " ".join([run_name(result)] + [f"{k}={cfg.get(k)}" for k in varying])
        rows.append({"run": label, **result, "out": str(where)})
    order = {name: i for i, name in enumerate(dict.fromkeys(r["run"] for r in rows))}
    return sorted(rows, key=lambda r: (order[r["run"]], r["seed"] or 0))


def select_runs(rows: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """The rows of the runs named (as collect_rows names them), in the order named: a report of
    a few arms of a larger comparison. ValueError naming what is there when a name is not."""
    if not names:
        raise ValueError("--runs names no run; give the report's names, e.g. bf16,nvfp4")
    found = dict.fromkeys(r["run"] for r in rows)
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"--runs: no finished run named {', '.join(missing)}; the runs found "
                         f"are {', '.join(found)}")
    return [r for n in dict.fromkeys(names) for r in rows if r["run"] == n]


SMOOTH_STEPS = 10  # the plot's running mean of the per-step mismatch


def rolling_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the up to window - 1 before it."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """k3 and max |dlogp| per step (log scale; faint, with their running mean) and reward per
    step (faint) under pass@1, one colour per run (its seeds in that colour)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (kx, dx, rx) = plt.subplots(1, 3, figsize=(18, 4.5))
    names = list(dict.fromkeys(r["run"] for r in rows))
    # Up to 10 runs take matplotlib's default cycle, more the 20 of tab20: no two runs alike.
    palette = plt.get_cmap("tab10" if len(names) <= 10 else "tab20").colors
    colours = {name: palette[i % len(palette)] for i, name in enumerate(names)}
    labelled: set[str] = set()
    for r in rows:
        label = r["run"] if r["run"] not in labelled else None  # a run's seeds share one entry
        labelled.add(r["run"])
        colour = colours[r["run"]]
        records = read_metrics(r["out"])
        metrics = [m for m in records if "k3" in m]
        steps = [m["step"] for m in metrics]
        for ax, key in ((kx, "k3"), (dx, "logp_diff_max")):
            values = [max(float(m[key]), 1e-12) for m in metrics]
            ax.plot(steps, values, color=colour, alpha=0.25, linewidth=0.8)
            ax.plot(steps, rolling_mean(values, SMOOTH_STEPS), color=colour, label=label)
        evals = [(m["step"], m["pass_at_1"]) for m in records if "pass_at_1" in m]
        rewards = rolling_mean([m["reward"] for m in metrics], SMOOTH_STEPS)
        # A run without evaluations (eval_every 0) is named by its reward line.
        rx.plot(steps, rewards, color=colour, alpha=0.3, linewidth=0.8,
                label=None if evals else label)
        if evals:
            rx.plot(*zip(*evals, strict=True), "o-", color=colour, markersize=3, label=label)
    kx.set_yscale("log")
    dx.set_yscale("log")
    kx.set_title(f"trainer-rollout mismatch k3 per step (0 drawn at 1e-12; "
                 f"{SMOOTH_STEPS}-step mean)")
    dx.set_title(f"max |log p_train - log p_rollout| per step ({SMOOTH_STEPS}-step mean)")
    rx.set_title(f"greedy pass@1 (markers), reward ({SMOOTH_STEPS}-step mean, faint)")
    for ax in (kx, dx, rx):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
