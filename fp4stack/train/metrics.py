"""Run logs: one JSON object per logged step in DIR/metrics.jsonl, and TensorBoard scalars.

A record holds: step (optimizer steps done, 1-based), tokens (step x global batch x seq_len),
loss (this step's training loss, averaged over micro-batches and ranks, MoE aux loss included),
lr, grad_norm (global, before clipping), tokens_per_s (all ranks, training time only, since the
previous record); val_loss on evaluation steps (cross-entropy only); val_loss_high_precision at
the last step and at a precision switch (the same weights, every quantizer off); high_precision:
true on the steps after a switch; skipped: true and reason on a step whose optimizer update was
skipped.

metrics.jsonl is the source of truth (plots, tests and comparisons read it); TensorBoard is a
convenience, skipped with a one-line notice when the package is not installed. On resume, lines
past the checkpoint's step are dropped first, so the file never holds a step twice.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def _json_value(v: Any) -> Any:
    # JSON has no NaN/Inf; a skipped step's loss is logged as the string "nan" / "inf".
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


@functools.cache
def _note_no_tensorboard() -> None:
    # once per process: a comparison opens a logger per run
    print("fp4stack: tensorboard is not installed; metrics go to each run's metrics.jsonl only",
          file=sys.stderr)


def read_metrics(out_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of DIR/metrics.jsonl, in order."""
    path = Path(out_dir) / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLogger:
    """Appends records to DIR/metrics.jsonl (and TensorBoard); does nothing when not enabled
    (ranks other than 0)."""

    def __init__(self, out_dir: Path, enabled: bool, tensorboard: bool,
                 resume_step: int | None = None) -> None:
        self.enabled = enabled
        self.tb = None
        self.file = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / METRICS_FILE
        kept = [r for r in read_metrics(out_dir) if r["step"] <= resume_step] if resume_step else []
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, path)
        self.file = path.open("a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                _note_no_tensorboard()
            else:
                self.tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=resume_step)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({k: _json_value(v) for k, v in record.items()}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    tag = "val/" + k[4:] if k.startswith("val_loss") else f"train/{k}"
                    self.tb.add_scalar(tag, v, record["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
