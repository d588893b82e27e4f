"""16-point random Hadamard transform (RHT) of 16-element blocks.

Each block x (a row of 16) becomes y = x · diag(s) · H16 / 4, with H16 the Sylvester Hadamard
matrix and s a fixed +-1 sign vector. The matrix diag(s)·H16/4 is orthogonal, so the transform
preserves norms and cancels in a product of two transformed operands: (xM)(dyM)ᵀ = x dyᵀ.

The product by H16 is computed as a fast Walsh-Hadamard transform with a fixed butterfly order
(pair distance 8, 4, 2, 1), so every float32 addition is specified and the Triton kernels
reproduce the reference bit for bit.
"""

from __future__ import annotations

import torch

BLOCK = 16
# Fixed random signs (drawn once; part of the format: changing them changes every RHT result).
RHT_SIGNS = (1, -1, 1, 1, -1, 1, -1, -1, 1, 1, -1, 1, -1, -1, -1, 1)
_NORM = 0.25  # 1 / sqrt(16), exact in binary


def hadamard_matrix(n: int = BLOCK, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix (n a power of two), entries +-1."""
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def rht_matrix(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """M = diag(s) · H16 / 4, the orthogonal matrix a block is multiplied by (x -> x M)."""
    signs = torch.tensor(RHT_SIGNS, dtype=dtype)
    return signs[:, None] * hadamard_matrix(BLOCK, dtype) * _NORM


def _walsh_hadamard(v: torch.Tensor) -> torch.Tensor:
    # v: [..., 16] float32 -> v · H16, butterflies at distance 8, 4, 2, 1.
    lead = v.shape[:-1]
    d = BLOCK // 2
    while d >= 1:
        w = v.reshape(*lead, BLOCK // (2 * d), 2, d)
        a, b = w[..., 0, :], w[..., 1, :]
        v = torch.stack((a + b, a - b), dim=-2).reshape(*lead, BLOCK)
        d //= 2
    return v


def _signs(device: torch.device) -> torch.Tensor:
    return torch.tensor(RHT_SIGNS, dtype=torch.float32, device=device)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rht(x: torch.Tensor) -> torch.Tensor:
    """Forward transform of every 16-element block of the last dim (K % 16 == 0), in float32
    (float64 for float64 input)."""
    if x.shape[-1] % BLOCK:
        raise ValueError(f"rht needs the last dim to be a multiple of 16, got {x.shape[-1]}")
    blocks = x.to(_compute_dtype(x)).reshape(*x.shape[:-1], -1, BLOCK)
    y = _walsh_hadamard(blocks * _signs(x.device)) * _NORM
    return y.reshape(x.shape)


def rht_inverse(y: torch.Tensor) -> torch.Tensor:
    """Inverse of `rht` (its transpose): y -> y · H16 · diag(s) / 4, in float32 (float64 for
    float64 input)."""
    if y.shape[-1] % BLOCK:
        raise ValueError(f"rht_inverse needs a last dim multiple of 16, got {y.shape[-1]}")
    blocks = y.to(_compute_dtype(y)).reshape(*y.shape[:-1], -1, BLOCK)
    x = _walsh_hadamard(blocks) * _NORM * _signs(y.device)
    return x.reshape(y.shape)
