"""`fp4stack rl` and `fp4stack rl-compare` (registered in fp4stack/cli.py).

    fp4stack rl --config configs/rl/tiny.yaml --rollout quads --trainer qat-w --steps 50
    fp4stack rl-compare --config configs/rl/tiny.yaml --out runs/rl-compare/tiny
    fp4stack rl-compare --config configs/rl/tiny.yaml --runs bf16 --sweep lr=1e-4,3e-4
    fp4stack rl-compare --report-from runs/session1,runs/session2 --out runs/rl-compare/all
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..train.command import add_jobs_argument

# The config's choices, spelled out so that building the parser imports no torch (a test checks
# them against rl.config's).
ROLLOUTS = ("bf16", "fp8", "nvfp4", "quads", "w4a16", "nvfp4-token", "quads-token")
TRAINERS = ("bf16", "qat-w")
CORRECTIONS = ("none", "token-tis", "token-mis", "seq-tis", "seq-mis")
ENGINES = ("auto", "fast", "reference")


def _listed(text: str) -> list[str]:
    """The non-empty names of a comma-separated flag value."""
    return [name for name in text.split(",") if name]


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config (presets: configs/rl/*.yaml); default: the "
                   "built-in defaults (tiny MoE GPT on 2-digit addition)")
    p.add_argument("--steps", type=int, help="GRPO steps (default: the config's)")
    p.add_argument("--task", help="built-in task (arithmetic:add, countdown, ...) or "
                   "package.module:callable")
    p.add_argument("--seed", type=int, help="seed of init, prompts and sampling")
    p.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--max-minutes", type=float,
                   help="wall-time limit of a run: it stops after the last step that fits, "
                        "with a final evaluation (default: the config's; 0 = none)")


def add_rl_arguments(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--rollout", choices=ROLLOUTS,
                   help="rollout precision (default: the config's)")
    p.add_argument("--trainer", choices=TRAINERS, help="trainer recipe")
    p.add_argument("--correction", choices=CORRECTIONS,
                   help="rollout correction (importance weights on the policy loss)")
    p.add_argument("--routing-replay", action="store_true", default=None,
                   help="replay the rollout's MoE routing in the trainer")
    p.add_argument("--four-over-six", action="store_true", default=None,
                   help="Four Over Six NVFP4 block scales in the engine and the qat-w trainer "
                        "alike (the config's four_over_six)")
    p.add_argument("--engine", choices=ENGINES,
                   help="rollout engine: fast (static KV cache, CUDA-graph steps), reference, "
                        "or auto (fast for fp4stack GPT policies on CUDA; the default)")
    p.add_argument("--engine-device",
                   help="the rollout engine's own device, e.g. cuda:1 (default: the config's; "
                        "'same' is the trainer's), or 'process': under torchrun "
                        "--nproc_per_node=2, rank 1 runs the engine on its own device")
    p.add_argument("--off-policy", type=int, choices=(0, 1),
                   help="1: sample the next step's rollouts while this step trains (one step "
                        "of policy lag; overlaps rollout and training on two devices)")
    p.add_argument("--out", help="output directory; {rollout} and {trainer} are filled in")


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--runs",
                   help="comma-separated runs, each ROLLOUT[@FRACTION][:static|:dynamic]"
                        "[/TRAINER][+tis], e.g. quads@0.5, quads@0.25:dynamic, w4a16, "
                        "nvfp4-token/qat-w (default bf16,fp8,nvfp4,nvfp4+tis,quads); with "
                        "--report-from, the runs to report, named as its table names them "
                        "(default: every run found)")
    p.add_argument("--seeds", help="comma-separated seeds: every run once per seed, each seed "
                                   "from its own SFT start (default: the config's seed)")
    p.add_argument("--sweep", metavar="FIELD=V1,V2,...",
                   help="repeat every run once per value of one config field, from the same "
                        "SFT start (e.g. lr=1e-6,3e-6 or kl_coef=0,0.001)")
    p.add_argument("--out", default="runs/rl-compare", help="output directory")
    p.add_argument("--report-from", metavar="DIR,DIR,...",
                   help="train nothing: write the report (table, seed means, plot) into --out "
                        "from the finished runs under these directories, e.g. one comparison's "
                        "arms trained in several sessions; runs of a seed that start from "
                        "different weights are flagged (exit status 1)")
    add_jobs_argument(p)
    p.add_argument("--verbose", action="store_true",
                   help="print every run's log (SFT, each step, each mismatch alarm); default: "
                   "a progress bar and one line per run")


def _config(args: argparse.Namespace, **extra):
    from .config import load_rl_config

    return load_rl_config(args.config, steps=args.steps, task=args.task, seed=args.seed,
                          device=args.device, max_minutes=args.max_minutes, **extra)


def _fail(command: str, e: Exception) -> int:
    print(f"fp4stack {command}: error: {e}", file=sys.stderr)
    return 2


def run_rl_command(args: argparse.Namespace) -> int:
    from .metrics import MismatchAlarmError
    from .sync import WeightSyncError
    from .trainer import run_rl

    try:
        cfg = _config(args, rollout=args.rollout, trainer=args.trainer,
                      correction=args.correction, routing_replay=args.routing_replay,
                      four_over_six=args.four_over_six,
                      engine=args.engine, engine_device=args.engine_device,
                      off_policy=args.off_policy, out=args.out)
        result = run_rl(cfg)
        if result is None:  # the engine process of engine_device: process
            return 0
    except (ValueError, FileNotFoundError, ImportError) as e:
        return _fail("rl", e)
    except (WeightSyncError, MismatchAlarmError) as e:
        print(f"fp4stack rl: stopped: {e}", file=sys.stderr)
        return 1
    print(f"done: final reward {result['final_reward']:.3f}, pass@1 "
          f"{result['final_pass_at_1']}, mean k3 {result['k3_mean']:.2e}; {result['out']}")
    return 0


def _report_from(args: argparse.Namespace) -> int:
    from .compare_report import collect_rows, select_runs, start_conflicts, write_report

    try:
        rows = collect_rows(_listed(args.report_from))
        if args.runs:
            rows = select_runs(rows, _listed(args.runs))
        write_report(rows, Path(args.out))
    except (ValueError, FileNotFoundError) as e:
        return _fail("rl-compare", e)
    print((Path(args.out) / "rl_compare.md").read_text().rstrip())
    print(f"\nwritten: {args.out}/rl_compare.md, rl_compare.json, rl_compare.png")
    return 1 if start_conflicts(rows) else 0


def run_compare_command(args: argparse.Namespace) -> int:
    from ..parallel_runs import RunsFailedError
    from .compare import DEFAULT_RUNS, run_rl_comparison
    from .compare_report import format_table

    if args.report_from:
        return _report_from(args)
    try:
        seeds = [int(s) for s in _listed(args.seeds)] if args.seeds else None
        runs = _listed(args.runs) if args.runs else list(DEFAULT_RUNS)
        rows = run_rl_comparison(_config(args), runs, args.out,
                                 verbose=args.verbose, seeds=seeds, jobs=args.jobs,
                                 sweep=args.sweep)
    except (ValueError, FileNotFoundError, ImportError) as e:
        return _fail("rl-compare", e)
    except RunsFailedError as e:
        print(f"fp4stack rl-compare: {e}", file=sys.stderr)
        return 1
    print(format_table(rows))
    print(f"\nwritten: {args.out}/rl_compare.md, rl_compare.json, rl_compare.png")
    return 0
