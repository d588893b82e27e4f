"""`fp4stack rl-compare`: rollout precisions side by side from the same SFT start.

A run is named `ROLLOUT[@FRACTION][:static|:dynamic][/TRAINER][+tis]`: the rollout precision
(rollout.PRECISIONS: bf16, fp8, nvfp4, quads, w4a16, nvfp4-token, quads-token), for quads the
fraction of channels compensated and `:static` (channels calibrated once) or `:dynamic` (picked
per batch), by default the config's compensation and compensation_mode; the trainer (default
qat-w, weights quantized as the rollout's, where the rollout quantizes weights with compensation
or alone: quads, quads-token, w4a16; else bf16) and token-level truncated importance sampling.
So bf16, fp8, nvfp4, nvfp4+tis, quads, quads@0.5, quads@0.5:dynamic, w4a16 and nvfp4-token/qat-w
are all runs. A run trains in out/<name as typed>; reports name it in full (`quads` is
quads@0.5:static under the default config), as `--report-from` does. With several seeds each
run repeats per seed from that seed's own SFT start (out/sft, out/sft-seed<N>); a sweep
(`lr=1e-6,3e-6`) repeats each run per value. Writes DIR/rl_compare.md (pass@1 at the start and
at the end, final reward, k3, mean and max |dlogp|), rl_compare.json and rl_compare.png (k3,
max |dlogp|, pass@1 and reward per step), with a table of the means over the seeds when there
are several (compare_report.py, which also merges the arms of one comparison trained in
several sessions: `--report-from`).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import finished_runs
from ..finished_runs import set_aside
from ..parallel_runs import LOG_NAME, Job, run_jobs
from .compare_report import SAVED_DEFAULTS, run_name, write_report
from .config import RUN_FIELDS, RLConfig, default_trainer
from .start import warm_up_policy
from .trainer import run_rl

DEFAULT_RUNS = ("bf16", "fp8", "nvfp4", "nvfp4+tis", "quads")
_RUN = re.compile(r"(?P<rollout>[a-z0-9-]+)(@(?P<fraction>[0-9.]+))?(:(?P<mode>static|dynamic))?"
                  r"(/(?P<trainer>[a-z0-9-]+))?(?P<tis>\+tis)?")


def parse_run(name: str) -> dict[str, Any]:
    """The config overrides of run `name` (see the module doc); ValueError naming the part that
    is wrong."""
    from .config import TRAINERS
    from .rollout import PRECISIONS

    m = _RUN.fullmatch(name)
    if m is None:
        raise ValueError(f"run {name!r} is not ROLLOUT[@FRACTION][:static|:dynamic][/TRAINER]"
                         "[+tis], e.g. quads@0.5, quads@0.5:dynamic or nvfp4/qat-w+tis")
    rollout = m["rollout"]
    if rollout not in PRECISIONS:
        raise ValueError(f"run {name!r}: rollout {rollout!r} is not one of {list(PRECISIONS)}")
    trainer = m["trainer"] or default_trainer(rollout)
    if trainer not in TRAINERS:
        raise ValueError(f"run {name!r}: trainer {trainer!r} is not one of {list(TRAINERS)}")
    overrides = {"rollout": rollout, "trainer": trainer,
                 "correction": "token-tis" if m["tis"] else "none"}
    if m["fraction"] is not None:
        if not rollout.startswith("quads"):
            raise ValueError(f"run {name!r}: @FRACTION is the compensated channels of a quads "
                             "rollout")
        fraction = float(m["fraction"])
        if not 0 < fraction <= 1:
            raise ValueError(f"run {name!r}: the fraction must be in (0, 1], got {fraction}")
        overrides["compensation"] = fraction
    if m["mode"] is not None:
        if not rollout.startswith("quads"):
            raise ValueError(f"run {name!r}: :{m['mode']} is the compensation mode of a quads "
                             "rollout")
        overrides["compensation_mode"] = m["mode"]
    return overrides


_BOOLS = {"true": True, "false": False}


def parse_sweep(text: str, cfg: RLConfig) -> tuple[str, list[tuple[str, Any]]]:
    """`FIELD=V1,V2,...` -> (field, [(as typed, value), ...]): one scalar RLConfig field, each
    value converted to the type of cfg's; ValueError naming what is wrong."""
    from .start import SFT_KEYS

    field_name, sep, values = text.partition("=")
    field_name = field_name.strip()
    if not sep or not field_name or not values.strip():
        raise ValueError(f"sweep {text!r} is not FIELD=V1,V2,..., e.g. lr=1e-6,3e-6")
    if not hasattr(cfg, field_name):
        raise ValueError(f"sweep: {field_name!r} is not an RL config field")
    # A sweep may not vary what the run names, --seeds and --out set (RUN_FIELDS), nor what
    # makes the SFT start the runs share (SFT_KEYS).
    if field_name in RUN_FIELDS or field_name in SFT_KEYS:
        raise ValueError(f"sweep: {field_name} cannot be swept: it is set by the run names or "
                         "--seeds, or it changes the SFT start the runs share (use separate "
                         "--out directories for that)")
    current = getattr(cfg, field_name)
    kind = type(current)
    if kind not in (int, float, str, bool):
        raise ValueError(f"sweep: {field_name} is not a scalar field")
    parsed = []
    for raw in (v.strip() for v in values.split(",")):
        try:
            value = _BOOLS[raw.lower()] if kind is bool else kind(raw)
        except (KeyError, ValueError):
            raise ValueError(f"sweep: {field_name}={raw!r} is not of type {kind.__name__}"
                             ) from None
        cfg.with_overrides(**{field_name: value})  # the config's own checks, naming the field
        parsed.append((raw, value))
    if len({v for _, v in parsed}) != len(parsed):
        raise ValueError(f"sweep: {field_name} lists a value twice")
    return field_name, parsed


# Fields that do not change what a finished run computed; and those only a quads rollout reads.
_NOT_COMPARED = ("out", "device", "max_minutes")
_QUADS_ONLY = ("compensation", "compensation_mode", "calibration_size")


def stale_fields(run_dir: Path, cfg: RLConfig) -> list[str]:
    """The fields, as "name (saved -> now)", in which the run in run_dir was trained with
    another value than cfg has ([] when they agree, or when it has no config.json)."""
    ignored = _NOT_COMPARED + (() if cfg.rollout.startswith("quads") else _QUADS_ONLY)
    return finished_runs.stale_fields(run_dir, cfg.to_dict(), SAVED_DEFAULTS, ignored)


def run_rl_comparison(cfg: RLConfig, runs: list[str], out: str | os.PathLike,
                      log: Callable[[str], None] = print, verbose: bool = True,
                      seeds: list[int] | None = None, jobs: int = 1,
                      sweep: str | None = None) -> list[dict[str, Any]]:
    """Train each named run (see the module doc) from `cfg` (same task and SFT start) into
    out/<name>, or out/<name>/seed<N> for each of several `seeds` (default: the config's); a
    finished run (result.json present) is reused when its config.json agrees with the run's
    config; one trained with other values (a changed config or default) is moved under
    out/.stale/ and trained again, with a line to `log` naming the fields.

    sweep: `FIELD=V1,V2,...` (parse_sweep) repeats every run once per value, as run
    "<name> FIELD=V" in out/<name>-FIELD<V>, all from the same SFT start: e.g. the lr of the
    BF16 run swept before a comparison.

    verbose: every log line of every run goes to `log`. Otherwise each run shows a progress bar
    (on a terminal, with tqdm installed) and `log` gets one line per run: its steps, time and
    how often the mismatch alarm fired. jobs > 1 makes each seed's SFT start, then trains that
    many runs at once, each in its own process writing its output to <run dir>/run.log
    (`parallel_runs`).
    """
    if jobs < 1:
        raise ValueError(f"jobs (--jobs) must be >= 1, got {jobs}")
    # (directory name, overrides, label suffix) per run and swept value; every name checked
    # first. A run's label is its full name (a quads run with the share and mode its config
    # gives it), as `--report-from` names it; the directory keeps the name as typed.
    variants = [(name, parse_run(name), "") for name in runs]
    if sweep is not None:
        field_name, values = parse_sweep(sweep, cfg)
        variants = [(f"{dirname}-{field_name}{raw}", {**overrides, field_name: value},
                     f" {field_name}={raw}")
                    for dirname, overrides, _ in variants for raw, value in values]
    variants = [(run_name(cfg.with_overrides(**o).to_dict()) + suffix, dirname, o)
                for dirname, o, suffix in variants]
    seeds = list(seeds) if seeds else [cfg.seed]
    out = Path(out)
    labels = [label for label, _, _ in variants]
    if len(set(labels)) < len(labels):
        raise ValueError(f"runs {runs} name the same run twice ({labels}): drop the repeat")
    planned, warm_ups, pending = [], {}, []
    for seed in seeds:
        sft = out / ("sft" if seed == cfg.seed else f"sft-seed{seed}")
        for name, dirname, overrides in variants:
            run_dir = out / dirname if len(seeds) == 1 else out / dirname / f"seed{seed}"
            planned.append((name, seed, run_dir))
            run_cfg = cfg.with_overrides(**overrides, seed=seed, out=str(run_dir))
            if (run_dir / "result.json").exists():
                changed = stale_fields(run_dir, run_cfg)
                if not changed:
                    continue  # finished with this very config: reused
                aside = set_aside(run_dir, out)
                log(f"{run_dir}: its finished run differs from this config in "
                    f"{', '.join(changed)}: trained again (the old run is now in {aside})")
            label = name if len(seeds) == 1 else f"{name} seed {seed}"
            if jobs > 1:  # each seed's SFT start first, then the runs side by side
                warm_ups.setdefault(seed, Job(f"SFT warm-up, seed {seed}", warm_up_policy,
                                              dict(cfg=run_cfg, cache_dir=sft), sft / LOG_NAME))
                pending.append(Job(label, run_rl, dict(cfg=run_cfg, cache_dir=sft),
                                   run_dir / LOG_NAME))
            elif verbose:
                run_rl(run_cfg, log=log, cache_dir=sft)
            else:
                with RunProgress(label, run_cfg.steps) as progress:
                    result = run_rl(run_cfg, log=progress.log, cache_dir=sft)
                log(progress.summary(result, run_cfg.alarm_k3))
    run_jobs(list(warm_ups.values()), jobs, log)
    run_jobs(pending, jobs, log)
    rows = [{"run": name, "seed": seed, **json.loads((run_dir / "result.json").read_text())}
            for name, seed, run_dir in planned]
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
