"""Learning-rate schedule: linear warmup, then cosine decay to min_lr.

A pure function of the step (no scheduler object), so a resumed run needs no schedule state and
every recipe of a comparison sees the same learning rates.
"""

from __future__ import annotations

import math


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based).

    Warmup: lr * (step + 1) / warmup_steps, so the first step already moves the weights. Then
    cosine from lr to min_lr, reached at step `decay_steps`, and min_lr after it.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
