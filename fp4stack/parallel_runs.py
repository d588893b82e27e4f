"""Several training runs at once, each in its own process, for `compare --jobs` and
`rl-compare --jobs`.

One GPU trains a host-bound run (an FP4 recipe's launches, a rollout's decode) at a fraction of
its throughput, so runs started side by side finish sooner together than one after another;
the results do not depend on it, as every run has its own process, seeds and output directory.
Each run's output goes to a log file in its directory; the caller gets a line as each ends.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

LOG_NAME = "run.log"


@dataclass(frozen=True)
class Job:
    """One run: `fn(**kwargs)` (a module-level function, so a fresh process can import it), its
    stdout and stderr written to `log`."""

    label: str
    fn: Callable[..., Any]
    kwargs: dict[str, Any] = field(default_factory=dict)
    log: Path | None = None


class RunsFailedError(RuntimeError):
    """Some runs of a parallel batch raised; the others finished. `failed` maps each failed run's
    label to its error."""

    def __init__(self, failed: dict[str, str]) -> None:
        self.failed = failed
        lines = "\n".join(f"  {k}: {v}" for k, v in failed.items())
        super().__init__(f"{len(failed)} run(s) failed:\n{lines}")


def _in_child(fn: Callable[..., Any], kwargs: dict[str, Any], log: str | None,
              threads: int) -> Any:
    # The parent's CPU thread count: a CPU run's reductions, and so its bits, can depend on it.
    torch.set_num_threads(threads)
    if log is not None:
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        f = open(log, "a", buffering=1)  # noqa: SIM115 (held for the life of the process)
        # At the descriptor level, so output from C code and child threads lands there too.
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        sys.stdout = sys.stderr = f
    try:
        return fn(**kwargs)
    except BaseException as e:
        traceback.print_exc()
        # Re-raised as a plain error: the parent may not be able to unpickle every exception.
        raise RuntimeError(f"{type(e).__name__}: {e}") from None


def run_jobs(jobs: list[Job], parallel: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run `jobs`, at most `parallel` at a time, each in a fresh ("spawn") process; returns each
    label's result once all have ended. A failed run does not stop the others; then
    RunsFailedError names every failure (its traceback is in its log)."""
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    results: dict[str, Any] = {}
    failed: dict[str, str] = {}
    if not jobs:
        return results
    start = time.monotonic()
    context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    with ProcessPoolExecutor(max_workers=min(parallel, len(jobs)), mp_context=context) as pool:
        threads = torch.get_num_threads()
        futures = {pool.submit(_in_child, j.fn, j.kwargs, None if j.log is None else str(j.log),
                               threads): j for j in jobs}
        log(f"started {len(jobs)} run(s), {min(parallel, len(jobs))} at a time, each writing "
            f"its output to its log ({LOG_NAME} in its directory)")
        for future in as_completed(futures):
            job = futures[future]
            minutes = (time.monotonic() - start) / 60
            try:
                results[job.label] = future.result()
                log(f"{job.label}: done ({minutes:.1f} min since the start)")
            except Exception as e:  # noqa: BLE001 (reported with the others below)
                failed[job.label] = f"{e}" + (f" (log: {job.log})" if job.log else "")
                log(f"{job.label}: FAILED ({minutes:.1f} min): {failed[job.label]}")
    if failed:
        raise RunsFailedError(failed)
    return results
