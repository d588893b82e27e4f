"""What the attention kernels' modules share: the launch tile, the E4M3 scale maximum and the
amax that makes a raw tensor its own units.

attention.py (forward), attention_units.py (operands) and attention_bwd.py (backward) import
from here, so none of them imports another one back.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton.language as tl

from ..formats.spec import QuantSpec

SCALE_MAX = QuantSpec().scale_max  # E4M3's 448
E4M3_RANGE = tl.constexpr(SCALE_MAX)  # the same for @triton.jit code: its globals are constexpr
# The global amax whose decode factor is exactly 1 (6 * 448 times fl32(1 / (6 * 448)) is 1 in
# fp32): a tensor the kernels take unquantized (V in Full-Stack FP4's own attention, the
# ablations' high-precision operands) is passed as its own units with this amax.
RAW_AMAX = 6.0 * SCALE_MAX


@dataclass(frozen=True)
class Tile:
    """One kernel's launch shape: BLOCK_M query rows, BLOCK_N key rows (powers of two >= 16)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def check_tile(t: Tile) -> None:
    """Raise ValueError unless block_m and block_n are powers of two >= 16."""
    # Powers of two (tl.arange) >= 16 (tl.dot; whole 16-blocks inside a tile).
    for name, n in (("block_m", t.block_m), ("block_n", t.block_n)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {n}")
