"""Blackwell's swizzled block-scale layout (cuBLAS / torch._scaled_mm block-scaled GEMMs).

Scales [rows, cols] are padded to rows % 128 == 0 and cols % 4 == 0 and cut into 128x4 tiles of
512 bytes, laid out row-major; inside a tile, entry (r, c) sits at byte
(r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4).
"""

from __future__ import annotations

import torch

TILE_ROWS, TILE_COLS = 128, 4


def _padded(n: int, m: int) -> int:
    return -(-n // m) * m


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """[rows, cols] scales -> flat swizzled tensor of padded_rows * padded_cols entries."""
    if scales.dim() != 2:
        raise ValueError(f"swizzle_scales takes [rows, cols] scales, got {tuple(scales.shape)}")
    rows, cols = scales.shape
    rp, cp = _padded(rows, TILE_ROWS), _padded(cols, TILE_COLS)
    raw = scales.view(torch.uint8) if scales.element_size() == 1 else scales
    padded = torch.nn.functional.pad(raw, (0, cp - cols, 0, rp - rows))
    # row r = 128 * tile_row + 32 * r4 + r32; col c = 4 * tile_col + c4
    tiles = padded.reshape(rp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).view(scales.dtype)


def unswizzle_scales(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `swizzle_scales`: back to [rows, cols]."""
    rp, cp = _padded(rows, TILE_ROWS), _padded(cols, TILE_COLS)
    if flat.numel() != rp * cp:
        raise ValueError(
            f"unswizzle_scales: {flat.numel()} entries do not fit [{rows}, {cols}] padded to "
            f"[{rp}, {cp}]"
        )
    raw = flat.view(torch.uint8) if flat.element_size() == 1 else flat
    tiles = raw.reshape(rp // 128, cp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(rp, cp)[:rows, :cols].contiguous().view(flat.dtype)
