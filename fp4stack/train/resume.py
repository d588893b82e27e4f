"""Which checkpoint a run continues from, and whether its config continues that run.

Checked before anything is built, so that a mismatch is named as such and does not surface as a
state-dict error. A resumed run must share the fields that make it the same run (model, batch,
seed, recipe); other changes warn, and those that only steer the run (max_steps, logging, ...)
pass silently.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .checkpoint import checkpoint_dirs, latest_checkpoint
from .checkpoint_check import checkpoint_problem
from .config import PretrainConfig

MUST_MATCH = ("model", "seq_len", "global_batch_size", "seed", "recipe")
FREE = ("out", "data", "max_steps", "log_every", "eval_every", "ckpt_every", "keep_checkpoints",
        "tensorboard", "device", "distributed", "max_nan_skips", "weight_flips")


def check_resume(saved: dict[str, Any], cfg: PretrainConfig, say: Callable[[str], None]) -> None:
    """ValueError when cfg differs from the checkpoint's config `saved` in a MUST_MATCH field;
    a warning through `say` for other changes and for a cosine that now ends elsewhere."""
    current = cfg.to_dict()
    for key in MUST_MATCH:
        if saved.get(key) != current[key]:
            raise ValueError(f"--resume: {key} is {current[key]!r} but the checkpoint was trained "
                             f"with {saved.get(key)!r}; resume with the same {key}, or start a "
                             "new run with another --out")
    changed = [k for k in current if k not in MUST_MATCH + FREE
               and saved.get(k, current[k]) != current[k]]
    if changed:
        say("warning: resuming with changed " + ", ".join(
            f"{k} ({saved[k]!r} -> {current[k]!r})" for k in changed))
    decay = saved.get("lr_decay_steps") or saved.get("max_steps")
    if decay != cfg.decay_steps:
        say(f"warning: the cosine now ends at step {cfg.decay_steps}, not {decay}: the resumed "
            "run's learning rates differ from the original run's")


def intact_checkpoint(out: Path, say: Callable[[str], None]) -> Path:
    """The newest intact checkpoint of the run in `out`, saying which damaged ones it passed
    over; ValueError naming each damaged file when none is intact."""
    damaged = []
    for path in reversed(checkpoint_dirs(out)):
        problem = checkpoint_problem(path)
        if not problem:
            if damaged:
                say(f"warning: {'; '.join(damaged)}: resuming from the newest intact "
                    f"checkpoint, {path.name}")
            return path
        damaged.append(problem)
    raise ValueError(f"--resume: no intact checkpoint in {out / 'checkpoints'}: "
                     f"{'; '.join(damaged)}. Remove the damaged checkpoints to start the run "
                     "again, or --out another directory for a new run")


def checkpoint_to_resume(cfg: PretrainConfig, resume: bool, train_tokens: int,
                         say: Callable[[str], None]) -> Path | None:
    """The checkpoint of cfg's run to continue (None: a new run), checked against cfg and the
    training data's size; a new run refuses an out directory that already holds a checkpoint."""
    out = cfg.out_dir
    ckpt = latest_checkpoint(out)
    if resume and ckpt is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {out / 'checkpoints'}")
    if not resume:
        if ckpt is not None:
            raise FileExistsError(f"{out} already holds a checkpoint ({ckpt.name}): pass --resume "
                                  "to continue that run, or --out another directory")
        return None
    ckpt = intact_checkpoint(out, say)
    saved = json.loads((ckpt / "state.json").read_text())
    check_resume(saved["config"], cfg, say)
    if saved["train_tokens"] != train_tokens:
        raise ValueError(f"--resume: the checkpoint was trained on {saved['train_tokens']} "
                         f"training tokens, {cfg.data} holds {train_tokens}")
    if saved["step"] > cfg.max_steps:
        raise ValueError(f"--resume: the checkpoint {ckpt} is at step {saved['step']}, past "
                         f"max_steps {cfg.max_steps}; pass --max-steps {saved['step']} or more "
                         "to continue that run, or --out another directory for a new run")
    return ckpt
