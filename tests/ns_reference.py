"""The spectral-cap estimate of fp4stack's NVFP4 Newton-Schulz, written out for the float64
reference chains of tests/test_muon4.py and tests/test_root.py."""

from __future__ import annotations

import torch


def top_eigenvalue(gram: torch.Tensor, iters: int = 16) -> float:
    """The documented estimate (not eigvalsh): power iteration from the all-ones and the
    alternating-sign vectors, the larger of their Rayleigh quotients."""
    best = -float("inf")
    for sign in (1.0, -1.0):
        v = torch.ones(len(gram), dtype=gram.dtype)
        v[1::2] = sign
        for _ in range(iters):
            v = gram @ v
            v = v / v.norm()
        best = max(best, (v @ gram @ v).item())
    return best
