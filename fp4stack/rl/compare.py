"""`fp4stack rl-compare`: rollout precisions side by side from the same SFT start.

The runs: bf16 (BF16 rollout, BF16 trainer), fp8 (W8A8 rollout), nvfp4 (naive W4A4 rollout),
nvfp4+token-tis (the same with truncated importance sampling) and quads (W4A4 + residual
compensation rollout, qat-w trainer). Writes DIR/rl_compare.md (final reward and pass@1, mean and
max k3), rl_compare.json and rl_compare.png (k3 and reward per step).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..files import make_output_dir
from ..train.metrics import read_metrics
from .config import RLConfig
from .trainer import run_rl

# name -> (rollout, trainer, correction)
RUNS = {
    "bf16": ("bf16", "bf16", "none"),
    "fp8": ("fp8", "bf16", "none"),
    "nvfp4": ("nvfp4", "bf16", "none"),
    "nvfp4+tis": ("nvfp4", "bf16", "token-tis"),
    "quads": ("quads", "qat-w", "none"),
}


def run_rl_comparison(cfg: RLConfig, runs: list[str], out: str | os.PathLike,
                      log: Callable[[str], None] = print, verbose: bool = True
                      ) -> list[dict[str, Any]]:
    """Train each named run from `cfg` (same seed, task and SFT start) into out/<name>; a
    finished run (result.json present) is reused.

    verbose: every log line of every run goes to `log`. Otherwise each run shows a progress bar
    (on a terminal, with tqdm installed) and `log` gets one line per run: its steps, time and
    how often the mismatch alarm fired.
    """
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        raise ValueError(f"unknown runs {unknown}; choose from {list(RUNS)}")
    out = Path(out)
    rows = []
    for name in runs:
        rollout, trainer, correction = RUNS[name]
        run_dir = out / name
        done = run_dir / "result.json"
        if done.exists():
            result = json.loads(done.read_text())
        else:
            run_cfg = cfg.with_overrides(rollout=rollout, trainer=trainer, correction=correction,
                                         out=str(run_dir))
            if verbose:
                result = run_rl(run_cfg, log=log, cache_dir=out / "sft")
            else:
                with RunProgress(name, run_cfg.steps) as progress:
                    result = run_rl(run_cfg, log=progress.log, cache_dir=out / "sft")
                log(progress.summary(result, run_cfg.alarm_k3))
        rows.append({"run": name, **result})
    write_report(rows, out)
    return rows


# run_rl's log lines that the progress bar stands for: SFT and GRPO steps, alarms, the setup.
_SFT_STEP = re.compile(r"sft step (\d+)/(\d+)")
_STEP = re.compile(r"step (\d+)/\d+ \|")
_QUIET = ("policy: ", "rl: ", "step 0: ")


class RunProgress:
    """One run's progress bar, fed by run_rl's log lines: a GRPO step advances it, an SFT
    step shows the warm-up in its description, alarms are counted for `summary`; any other
    line is printed above the bar."""

    def __init__(self, name: str, steps: int) -> None:
        self.name, self.alarms = name, 0
        try:
            from tqdm.auto import tqdm
        except ImportError:  # tqdm is optional (the train and demo extras)
            self.bar = None
        else:  # a bar's carriage returns clutter log files
            self.bar = tqdm(total=steps, desc=name, unit="step", dynamic_ncols=True,
                            disable=not sys.stderr.isatty())

    def __enter__(self) -> RunProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()

    def log(self, msg: str) -> None:
        sft, step = _SFT_STEP.match(msg), _STEP.match(msg)
        if msg.startswith("alarm: "):
            self.alarms += 1
        elif not (sft or step or msg.startswith(_QUIET)):
            (print if self.bar is None else self.bar.write)(msg)
        elif self.bar is None:
            return
        elif sft:
            self.bar.set_description(f"{self.name} (SFT warm-up {sft[1]}/{sft[2]})")
        elif msg.startswith("rl: "):  # GRPO starts: the bar's clock and rate leave the SFT out
            self.bar.set_description(self.name, refresh=False)
            self.bar.reset()
        elif step:
            self.bar.update(int(step[1]) - self.bar.n)

    def summary(self, result: dict[str, Any], alarm_k3: float) -> str:
        """One line: the run's steps and time, and how often the mismatch alarm fired."""
        line = f"{self.name}: {result['steps']} steps in {result['wall_s']:.1f} s"
        if self.alarms:
            line += f"; mismatch alarm (k3 > {alarm_k3:g}) at {self.alarms} of them"
        return line


def format_table(rows: list[dict[str, Any]]) -> str:
    # The median beside the mean: one spiking step can carry a run's mean k3.
    lines = ["| run | rollout | trainer | final reward | final pass@1 | mean k3 | median k3 "
             "| max k3 |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        p1, med = r.get("final_pass_at_1"), r.get("k3_median")
        lines.append(f"| {r['run']} | {r['rollout']} | {r['trainer']} | {r['final_reward']:.3f} "
                     f"| {'n/a' if p1 is None else f'{p1:.3f}'} | {r['k3_mean']:.2e} | "
                     f"{'n/a' if med is None else f'{med:.2e}'} | {r['k3_max']:.2e} |")
    return "\n".join(lines)


def write_report(rows: list[dict[str, Any]], out: Path) -> None:
    make_output_dir(out)
    (out / "rl_compare.md").write_text(format_table(rows) + "\n")
    (out / "rl_compare.json").write_text(json.dumps(rows, indent=1))
    with contextlib.suppress(ImportError):  # matplotlib is optional
        plot(rows, out / "rl_compare.png")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """k3 per step (log scale) and reward per step (pass@1 as markers), one colour per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (kx, rx) = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, r in enumerate(rows):
        metrics = [m for m in read_metrics(r["out"]) if "k3" in m]
        colour = f"C{i % 10}"
        steps = [m["step"] for m in metrics]
        kx.plot(steps, [max(float(m["k3"]), 1e-12) for m in metrics], color=colour,
                label=r["run"])
        rx.plot(steps, [m["reward"] for m in metrics], color=colour, alpha=0.6, label=r["run"])
        evals = [(m["step"], m["pass_at_1"]) for m in read_metrics(r["out"]) if "pass_at_1" in m]
        if evals:
            rx.plot(*zip(*evals, strict=True), "o--", color=colour, markersize=4)
    kx.set_yscale("log")
    kx.set_title("trainer-rollout mismatch k3 per step (0 drawn at 1e-12)")
    rx.set_title("reward per step (line), greedy pass@1 (markers)")
    for ax in (kx, rx):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
