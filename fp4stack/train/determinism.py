"""Bitwise run-to-run reproducibility for a training run (`deterministic: true`).

Same-seed BF16 runs on Hopper need not repeat: SDPA picks its cuDNN backend there, whose backward
has no deterministic mode in torch (the FP4 attention kernels' default backward is
deterministic). A deterministic run turns cuDNN attention off, so SDPA falls back to flash
attention, whose backward torch computes deterministically under
`torch.use_deterministic_algorithms(True)`, and asks torch for deterministic algorithms
everywhere, so that an op without one raises instead of varying silently. What this costs, and
how far apart runs end without it: docs/PERFORMANCE.md and docs/results/fullstack-gap.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

# cuBLAS reuses its workspace deterministically only with a fixed configuration, and torch
# refuses cuBLAS calls under deterministic algorithms without one.
CUBLAS_WORKSPACE = ":4096:8"


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool = True, warn_only: bool = False) -> Iterator[None]:
    """Within the block, run torch's deterministic algorithms and no cuDNN attention; the
    previous settings come back afterwards. enabled=False changes nothing; warn_only=True lets
    an op without a deterministic algorithm run (with torch's warning) instead of raising."""
    if not enabled:
        yield
        return
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cuda.cudnn_sdp_enabled(),
             os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        mode, warn_only, cudnn_sdp, workspace = saved
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
        torch.backends.cuda.enable_cudnn_sdp(cudnn_sdp)
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace


__all__ = ["CUBLAS_WORKSPACE", "deterministic_algorithms"]
