"""The NVFP4 operands of the attention kernels, as "units": the prologue that quantizes Q, K, V
for the forward (tensor reuse keeps them for the backward), and the backward's operands without
reuse (re-quantized along each GEMM's reduction dim). The ablations' other operands
(fp4stack.nn.attention_ablation) are built from quantize_units and unit_values.

quantize_units_kernel takes one program per 16-multiple row tile of a [B, H, N, d] tensor and
quantizes it from its global amax with the jit helpers of the NVFP4 kernels, so the values are
bit for bit the reference's, in 16-blocks along d, along the rows, or in 16x16 tiles; round to
nearest even or stochastically (a seed draws formats/random.py's uniforms at the reference's
linear indices). It stores units of the global scale: E2M1 value times E4M3 block scale, at
most 6 significant bits, exact in bf16, fp16 and fp32, in the input's dtype. A tensor's values
are its units times the scalar decode factor amax / (6 * 448) (unit_values), which the kernels
apply to their fp32 dot results. quantize_tile is also the backward's in-kernel quantizer of dS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.global_scale import global_decode_scale
from ..formats.random import seed_keys
from . import cdiv
from . import nvfp4_jit as jit
from .attention_common import SCALE_MAX, Tile
from .nvfp4 import _int32, _launch_options


@triton.jit
def quantize_tile(x, amax, BLOCK_AXIS: tl.constexpr, SCALE_MAX: tl.constexpr, u,
                  STOCHASTIC: tl.constexpr):
    """NVFP4 of a [R, C] fp32 tile in 16-element blocks along axis BLOCK_AXIS (1: along C,
    0: along R), or, BLOCK_AXIS 2, in 16x16 tiles (R and C multiples of 16): round to nearest
    even, or with STOCHASTIC by the [R, C] uniform draws u.

    Returns (units, dec): the dequantized values are units * dec, as the fake-quantize kernel
    computes them; units = E2M1 value * E4M3 block scale.
    """
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    s_enc, s_dec = jit.global_scales(amax, SCALE_MAX)
    if BLOCK_AXIS == 1:
        xb = tl.reshape(x, (R, C // 16, 16))
        sbits = jit.block_scale_bits(jit.abs_max(xb, 2), s_enc, 1.0 / 6.0)
        enc = jit.encode_factor(sbits, s_dec)[:, :, None]
        s = jit.e4m3_value(sbits)[:, :, None]
    elif BLOCK_AXIS == 0:
        xb = tl.reshape(x, (R // 16, 16, C))
        sbits = jit.block_scale_bits(jit.abs_max(xb, 1), s_enc, 1.0 / 6.0)
        enc = jit.encode_factor(sbits, s_dec)[:, None, :]
        s = jit.e4m3_value(sbits)[:, None, :]
    else:
        xb = tl.reshape(x, (R // 16, 16, C // 16, 16))
        tile_max = jit.abs_max(jit.abs_max(xb, 3), 1)
        sbits = jit.block_scale_bits(tile_max, s_enc, 1.0 / 6.0)
        enc = jit.encode_factor(sbits, s_dec)[:, None, :, None]
        s = jit.e4m3_value(sbits)[:, None, :, None]
    if STOCHASTIC:
        units = jit.e2m1_value(jit.e2m1_stochastic(xb * enc, tl.reshape(u, xb.shape))) * s
    else:
        units = jit.e2m1_rne_value(xb * enc) * s
    return tl.reshape(units, (R, C)), jit.global_decode(amax, SCALE_MAX)


@triton.jit
def quantize_units_kernel(x_ptr, u_ptr, amax_ptr, H, N, sxb, sxh, sxn, sxd, k1, k2,
                          D: tl.constexpr, BLOCK: tl.constexpr, AXIS: tl.constexpr,
                          SCALE_MAX: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Units of rows [BLOCK, D] of x [B, H, N, D] (any strides) into contiguous u [B*H, N, D];
    AXIS 1: 16-blocks along d, AXIS 0: along the rows, AXIS 2: 16x16 tiles (BLOCK is a
    multiple of 16, so a tile's blocks are the reference's; rows past N load as zeros, the
    reference's padding). STOCHASTIC: element (bh, n, c) draws uniform(index, keys k1, k2) at
    the linear index the reference gives it, x with its blocks' dim moved last and padded to
    whole blocks: (bh * N + n) * D + c along d, (bh * D + c) * Np + n along the rows."""
    pid, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    ok = rows < N
    base = x_ptr + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh
    x = tl.load(base + rows[:, None].to(tl.int64) * sxn + cols[None, :] * sxd,
                mask=ok[:, None], other=0.0).to(tl.float32)
    draws = x
    if STOCHASTIC:
        if AXIS == 1:
            index = (bh.to(tl.int64) * N + rows[:, None]) * D + cols[None, :]
        else:
            n_padded = tl.cdiv(N, 16) * 16
            index = (bh.to(tl.int64) * D + cols[None, :]) * n_padded + rows[:, None]
        draws = jit.uniform(index, k1.to(tl.uint32), k2.to(tl.uint32))
    units, _ = quantize_tile(x, tl.load(amax_ptr), AXIS, SCALE_MAX, draws, STOCHASTIC)
    tl.store(u_ptr + (bh.to(tl.int64) * N + rows[:, None]) * D + cols[None, :],
             units.to(u_ptr.dtype.element_ty), mask=ok[:, None])


def quantize_units(t, amax: torch.Tensor, axis: int, tile: Tile,
                   seed: int | None = None) -> torch.Tensor:
    """Units of t [B, H, N, d] quantized with global amax amax[0] in 16-blocks along d (axis 1),
    along N (axis 0) or in 16x16 tiles (axis 2): contiguous, in t's dtype (fp32 stays fp32).
    seed: stochastic rounding with the reference's draws for that seed (axes 0 and 1), else
    round to nearest even."""
    if seed is not None and axis == 2:
        raise ValueError("quantize_units: stochastic rounding of 16x16 tiles is not implemented")
    u = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    B, H, N, D = t.shape
    k1, k2 = (0, 0) if seed is None else seed_keys(seed)
    if N:
        quantize_units_kernel[(cdiv(N, tile.block_m), B * H)](
            t, u, amax, H, N, *t.stride(), _int32(k1), _int32(k2), D=D, BLOCK=tile.block_m,
            AXIS=axis, SCALE_MAX=SCALE_MAX, STOCHASTIC=seed is not None,
            num_warps=tile.num_warps, **_launch_options())
    return u


def quantize_operands(q, k, v, amax: torch.Tensor, tile: Tile, tiled: bool = False,
                      seeds: tuple[int | None, ...] = (None, None, None), quant_v: bool = True):
    """Units of Q̂, K̂ (blocks along d) and V̂ (blocks along keys), or with `tiled` of all three
    in 16x16 tiles: contiguous [B, H, *, d] in the input dtype (fp32 stays fp32);
    Q̂ = units * amax[0] / 2688, and so on. seeds: of Q, K, V (None: round to nearest even).
    quant_v False: V unquantized, a contiguous copy as its own units (amax[2] must then be
    RAW_AMAX; a copy, so that the custom ops never return their input)."""
    axes = (2, 2, 2) if tiled else (1, 1, 0)
    qu, ku = (quantize_units(t, amax[i:], axes[i], tile, seeds[i]) for i, t in enumerate((q, k)))
    vu = quantize_units(v, amax[2:], axes[2], tile, seeds[2]) if quant_v else _copy(v)
    return [qu, ku, vu]


def backward_operands(q, k, v, amax: torch.Tensor, tile: Tile,
                      score_seeds: tuple[int | None, int | None] = (None, None),
                      seeds: tuple[int | None, ...] = (None, None, None), quant_v: bool = True):
    """The units of the backward GEMMs without tensor reuse (reuse=False): (Q̂, K̂ along d, V̂
    for dP = dO V̂ᵀ, Q̂ for dK = dŜᵀ Q̂, K̂ for dQ = dŜ K̂) from the raw q, k, v, quantized
    afresh with the forward's amaxes (a tensor's global amax does not depend on the axis of its
    blocks): Q̂, K̂ along d with the forward's seeds score_seeds (S recomputed bit for bit as in
    the forward); the other three along each GEMM's own reduction dim (V̂ along d, Q̂ along
    queries, K̂ along keys) with `seeds` (of Q̂ for dK, K̂ for dQ, V̂ for dP; None: round to
    nearest even). quant_v False: V unquantized (the forward's amax[2] is RAW_AMAX)."""
    def units(t, i, axis, seed):
        return quantize_units(t, amax[i:], axis, tile, seed)

    v_dp = units(v, 2, 1, seeds[2]) if quant_v else _copy(v)
    return (units(q, 0, 1, score_seeds[0]), units(k, 1, 1, score_seeds[1]),
            v_dp, units(q, 0, 0, seeds[0]), units(k, 1, 0, seeds[1]))


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def unit_values(units: torch.Tensor, amax: torch.Tensor, i: int) -> torch.Tensor:
    """The fp32 values of tensor i's units: units times its global decode factor (amax[i] /
    2688), multiplied as the quantize kernels do (so, bit for bit, the reference's values)."""
    return units.float() * global_decode_scale(amax[i], SCALE_MAX)
