"""Rotary position embedding of q or k in one launch, for inference: the torch form
(`models.rope.apply_rope_reference`) is seven (upcast, negate, concatenate, two products, the
sum, the cast back), which a decoding step runs twice a block.

Each output is the torch form's arithmetic in the same order, every product and the sum rounded
to float32 on its own (the launch options forbid fused multiply-adds), then cast to x's dtype
with round-to-nearest-even: the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .nvfp4 import _launch_options

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, ROWS, S, H, sxb, sxs, sxh, scb, scs,
                HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows (b, s, h) of x [B, S, H, 2 * HALF] (strided; last dim contiguous) rotated by
    cos / sin [B or 1, S, 2 * HALF] (float32; batch stride scb 0 when shared), into a
    contiguous out."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_D)
    ok = (r < ROWS)[:, None] & (c < HALF)[None, :]
    h = r % H
    s = (r // H) % S
    b = r // (H * S)
    xrow = (b.to(tl.int64) * sxb + s * sxs + h * sxh)[:, None]
    crow = (b.to(tl.int64) * scb + s * scs)[:, None]
    x1 = tl.load(x_ptr + xrow + c[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + xrow + HALF + c[None, :], mask=ok, other=0.0).to(tl.float32)
    cos1 = tl.load(cos_ptr + crow + c[None, :], mask=ok, other=0.0)
    cos2 = tl.load(cos_ptr + crow + HALF + c[None, :], mask=ok, other=0.0)
    sin1 = tl.load(sin_ptr + crow + c[None, :], mask=ok, other=0.0)
    sin2 = tl.load(sin_ptr + crow + HALF + c[None, :], mask=ok, other=0.0)
    # x * cos + cat(-x2, x1) * sin, half by half
    y1 = x1 * cos1 + (-x2) * sin1
    y2 = x2 * cos2 + x1 * sin2
    orow = r.to(tl.int64)[:, None] * (2 * HALF)
    tl.store(out_ptr + orow + c[None, :], y1.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out_ptr + orow + HALF + c[None, :], y2.to(out_ptr.dtype.element_ty), mask=ok)


def supported(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `apply_rope` takes these tensors (else the torch form does, which also names a
    shape mismatch): cos / sin must be [S, hd], [1, S, hd] or [B, S, hd] for x [B, S, H, hd]."""
    if not (x.dim() == 4 and x.dtype in DTYPES and x.shape[-1] % 2 == 0 and x.stride(-1) == 1
            and cos.dtype == torch.float32 and cos.dim() in (2, 3) and x.numel() > 0):
        return False
    B, S, _, hd = x.shape
    return tuple(cos.shape[-2:]) == (S, hd) and (cos.dim() == 2 or cos.shape[0] in (1, B))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`models.rope.apply_rope_reference` in one launch: x [B, S, H, hd] (float32, bfloat16 or
    float16, its last dim contiguous), cos / sin [S, hd] or [B, S, hd] float32; out contiguous
    in x's dtype."""
    if not supported(x, cos):
        raise ValueError(f"rope kernel: x {x.dtype} {tuple(x.shape)} stride {x.stride()}, "
                         f"cos {cos.dtype} {tuple(cos.shape)}: see kernels.rope.supported")
    B, S, H, hd = x.shape
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos = cos.expand(B, S, hd) if cos.shape[0] == 1 else cos
    sin = sin.expand(B, S, hd) if sin.shape[0] == 1 else sin
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((B, S, H, hd), dtype=x.dtype, device=x.device)
    rows, half = B * S * H, hd // 2
    block_d = triton.next_power_of_2(half)
    block_r = max(1, 4096 // (2 * block_d))
    rope_kernel[(triton.cdiv(rows, block_r),)](
        x, cos, sin, out, rows, S, H, x.stride(0), x.stride(1), x.stride(2), cos.stride(0),
        cos.stride(1), HALF=half, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4,
        **_launch_options())
    return out
