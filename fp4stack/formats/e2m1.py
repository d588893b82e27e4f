"""E2M1 (FP4) element format: rounding to the grid, codes, and nibble packing.

Magnitude codes 0..7 mean 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign (code 8 is -0).
All functions take float32 tensors that are already scaled into the E2M1 range.
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Round-to-nearest-even decision points between neighbouring grid values. At a tie the even code
# wins, so a tie point below an odd code (0.25, 1.25, 2.5, 5.0) stays down (the test is `>`), and
# one below an even code (0.75, 1.75, 3.5) goes up (the test is `>=`).
_RNE_UP_STRICT = (0.25, 1.25, 2.5, 5.0)
_RNE_UP_INCLUSIVE = (0.75, 1.75, 3.5)


def _sign_bit(y: torch.Tensor) -> torch.Tensor:
    # -0.0 is not < 0, so it gets code 0, as in Transformer Engine's reference.
    return (y < 0).to(torch.uint8) << 3


def round_rne(y: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of float32 `y` by round-to-nearest-even, saturating at +-6.

    Comparisons of NaN are false, so NaN maps to code 0; +-Inf saturates to +-6.
    """
    a = y.abs()
    mag = torch.zeros_like(a, dtype=torch.uint8)
    for t in _RNE_UP_STRICT:
        mag += (a > t).to(torch.uint8)
    for t in _RNE_UP_INCLUSIVE:
        mag += (a >= t).to(torch.uint8)
    return mag | _sign_bit(y)


def grid_floor(a: torch.Tensor) -> torch.Tensor:
    """Magnitude code of the largest grid value <= a (a >= 0); 7 for a >= 6, 0 for NaN."""
    code = torch.zeros_like(a, dtype=torch.uint8)
    for g in E2M1_GRID[1:]:
        code += (a >= g).to(torch.uint8)
    return code


def round_stochastic(y: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of float32 `y` by stochastic rounding, saturating at +-6.

    `uniform` holds one draw in [0, 1) per element. |y| is rounded up to the next grid value when
    uniform < (|y| - lo) / (hi - lo), so E[value] = y for |y| <= 6. The fraction is exact in
    float32 (the gap is a power of two and |y| - lo is exact by Sterbenz), so any implementation
    given the same draws makes the same choices.
    """
    a = y.abs()
    lo = grid_floor(a)
    lo_val = code_to_value(lo)
    hi = torch.clamp(lo + 1, max=7)
    inv_gap = torch.where(lo < 4, 2.0, torch.where(lo < 6, 1.0, 0.5)).to(torch.float32)
    frac = (a - lo_val) * inv_gap
    up = (uniform < frac) & (lo < 7)
    mag = torch.where(up, hi, lo)
    return mag | _sign_bit(y)


def code_to_value(code: torch.Tensor) -> torch.Tensor:
    """float32 value of E2M1 codes (uint8, sign in bit 3)."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=code.device)
    mag = grid[(code & 7).long()]
    return torch.where((code & 8) != 0, -mag, mag)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the last dim (even length), even index in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack needs an even last dim, got shape {tuple(codes.shape)}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack(data: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack`: uint8 [..., n] -> codes uint8 [..., 2n]."""
    lo = data & 0x0F
    hi = data >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*data.shape[:-1], 2 * data.shape[-1])
