"""Fused AdamW4 step: every NVFP4-state tensor of a param group in four multi-tensor launches.

Bit-exact with the reference step (fp4stack/optim/adamw4.py, `AdamW4._step_param`) for the
default settings: transform "rank1", stochastic state rounding, first moment stored normalized.

The reference's chain per tensor has three global reductions (the rank-1 factors of the new v,
the amax of the stored v, the amax of the normalized m), so the step takes four passes. Rather
than writing fp32 intermediates, each pass recomputes the new m and v from what it reads, the
gradient and the old packed states (about 5 bytes per parameter):

    pass 0: p updated in place; float64 row, column and total sums of the new v (atomics)
    pass 1: the new rank-1 factors (written); amax of stored v = sqrt(v / estimate) (atomic max)
    pass 2: stored v quantized (stochastic rounding) and written to a transient buffer; read
            back as the next step will; amax of m / sqrt(v_read) (atomic max)
    pass 3: the new v read back from its codes; m / sqrt(v_read) quantized; the new m and v
            codes and block scales written over the old ones, in place

Memory. The old states are read until pass 3, where each program reads the old codes and block
scales of its own tile only (the block floor of v uses the scale of the same block), so after a
barrier it overwrites them in place with the new m it computed and the new v that pass 2 left
in the transient buffer (codes and block scales of every tensor of the launch, one allocation,
16-byte aligned per tensor: 0.5625 bytes per parameter). The fields every program reads the old
values of (the two fp32 amaxes, the rank-1 row and column factors) are double-buffered: the new
ones go to spares (`spares`, 8 bytes per tensor and 4 per row and per column), swapped with the
states at the end of the step. Resident between steps: the states (1.125 bytes per parameter,
4 per row and column) and these spares, plus the launch tables (8 x NMETA = 176 bytes and a
gradient pointer per tensor, 4 bytes per tile of 1024 elements, kept per set of tensors and per
parity of the spares: ~0.01 bytes per parameter for GPT-sized matrices). Transient,
allocated at each step and freed when it returns: the new v (0.5625 bytes per parameter) and a
float64 scratch (rows + columns + 2 slots per tensor: the sums and the two amaxes), and with
KEEP_FP32 the float32 m and v (8 bytes per parameter).

One launch covers all tensors: a table of per-tensor pointers and sizes (`meta`), a work list
mapping each program to its tensor, tiles of BM rows x KB 16-element blocks. Per-step scalars
(learning rate, bias corrections, the step for the rounding seeds) are kernel arguments, so
tensors are launched together only when their step counts agree (the caller groups them).
Bytes per parameter and step: gradient 4 x 4 passes, parameter 8 (read and write), old packed
v 0.5625 x 4 and m 0.5625 x 3 (pass 1 needs no m), the new v 0.5625 x 3 (written to the
transient buffer, read back, copied into the state) and m 0.5625 written: about 30.2, against
28 for torch's fused AdamW (fp32 p, grad, m, v).

Measured on an H200, the passes are bound by instructions, not by these bytes: each decodes the
old states, rounds square roots and divisions exactly (sqrt.rn / div.rn, several instructions
each, as bit-exactness needs) and, in passes 2 and 3, hashes and rounds stochastically, some
200-400 instructions per element and pass; the step took ~3.3x torch's fused AdamW (timed
before the states were rewritten in place, which adds a copy of the new v; not timed since).
"""

from __future__ import annotations

import operator

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..formats.random import lowbias32_int
from ..formats.tensor import BLOCK
from . import nvfp4_jit as jit
from .nvfp4 import _launch_options

# Tile of one program: BM rows x KB blocks of 16 (1024 elements), and its warps. The fastest of
# a small sweep on an H200 (95M parameters in 49 GPT matrices: 3.39 ms a step, against 1.03 ms
# for torch's fused AdamW; 16 x 8 took 3.91 ms, 4 x 8 with 2 warps 3.59 ms). The passes are
# bound by instructions, not bytes (0.56 to 0.84 ms each, ~5x their memory time): see the
# module docstring.
BM = 8
KB = 8
NUM_WARPS = 4
# Pass 0 writes the new m and v in float32 for the later passes to read, instead of each pass
# recomputing them from the gradient and the old states: 8 bytes per parameter more memory
# during the step (allocated and freed each step) and ~9 more moved, far fewer instructions.
# Bit-exact too (tested); not yet timed on a GPU, hence off.
KEEP_FP32 = False

# The state fields the fused step rewrites (all of a quantized "rank1" parameter's tensors).
FIELDS = ("exp_avg_data", "exp_avg_scales", "exp_avg_amax", "exp_avg_sq_data",
          "exp_avg_sq_scales", "exp_avg_sq_amax", "exp_avg_sq_row", "exp_avg_sq_col")
# The fields every program reads the old values of while the new ones are written (the 0-d
# amaxes, the rank-1 factors): double-buffered, the new values written into spares of these
# (`spares`), swapped with the states after the step. The packed codes and block scales are
# rewritten in place.
SMALL = ("exp_avg_amax", "exp_avg_sq_amax", "exp_avg_sq_row", "exp_avg_sq_col")

_get_small = operator.itemgetter(*SMALL)

# Columns of the per-tensor table: the parameter, the state fields, the spares of SMALL, then
# sizes and offsets (tl.constexpr: the kernel reads them as compile-time constants).
_P = tl.constexpr(0)
_OLD = tl.constexpr(1)
_NEW = tl.constexpr(1 + len(FIELDS))
_ROWS = tl.constexpr(1 + len(FIELDS) + len(SMALL))
_COLS = tl.constexpr(_ROWS + 1)
_TILE0 = tl.constexpr(_ROWS + 2)  # first program of this tensor in the work list
_COL_TILES = tl.constexpr(_ROWS + 3)
_SCRATCH = tl.constexpr(_ROWS + 4)  # offset of its float64 scratch
_INDEX = tl.constexpr(_ROWS + 5)  # the parameter's index in the optimizer (rounding seeds)
_ELEM0 = tl.constexpr(_ROWS + 6)  # offset of its elements in the KEEP_FP32 buffer
_VDATA = tl.constexpr(_ROWS + 7)  # byte offsets of its new v codes and block scales in the
_VSCALES = tl.constexpr(_ROWS + 8)  # transient buffer (16-byte aligned)
NMETA = tl.constexpr(_ROWS + 9)
# Field offsets inside the state group, in the order of FIELDS, and inside the spare group, in
# the order of SMALL.
_MD, _MS, _MA, _VD, _VS, _VA, _ROW, _COL = (tl.constexpr(i) for i in range(8))
_NMA, _NVA, _NROW, _NCOL = (tl.constexpr(i) for i in range(4))

_SALT = tl.constexpr(0x9E3779B9)  # formats/random.SEED_SALT
_DEC = tl.constexpr(1.0 / (6.0 * 448.0))  # decode scale per unit of amax: 1 / (E2M1 x E4M3 max)
_ZERO_SCALE_BOUND = tl.constexpr(12 * 2.0**-10)  # state_transforms._ZERO_SCALE_BOUND


@triton.jit
def _field(meta, col, ty: tl.constexpr):
    # Every pointer in the table is 16-byte aligned (the host checks): vector loads.
    return tl.multiple_of(tl.load(meta + col).to(tl.pointer_type(ty)), 16)


@triton.jit
def _uniform(index, k1, k2):
    """nvfp4_jit.uniform for int32 indices (a tensor of < 2**31 elements: no high word)."""
    h = jit.lowbias32(index.to(tl.uint32) ^ k1)
    h = jit.lowbias32(h ^ k2)
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _codes(b):
    """E2M1 codes [BM, KB, 8] of half-blocks from their 4 packed bytes b [BM, KB, 4]."""
    b = b.to(tl.int32)
    return tl.reshape(tl.join(b & 0xF, b >> 4), (b.shape[0], b.shape[1], 8))


@triton.jit
def _values(b_lo, b_hi, sbits, dec):
    """Values of a tile of an NVFP4 tensor as lo, hi half-blocks and its block scales, from its
    packed bytes, block scale bits and decode scale, in formats/nvfp4.dequantize's order:
    (e2m1 * scale) * (amax * (1 / 2688))."""
    s = jit.e4m3_value(sbits.to(tl.int32))[:, :, None]
    lo = (jit.e2m1_value(_codes(b_lo)) * s) * dec
    hi = (jit.e2m1_value(_codes(b_hi)) * s) * dec
    return lo, hi, s


@triton.jit
def _decode(meta, first, boff, soff, m4, bmask):
    """Values of a tile of a stored NVFP4 moment (see _values), its block scales and decode
    scale."""
    dec = tl.load(_field(meta, first + _MA, tl.float32)) * _DEC
    sbits = tl.load(_field(meta, first + _MS, tl.uint8) + soff, mask=bmask, other=0)
    data = _field(meta, first + _MD, tl.uint8)
    b_lo = tl.load(data + boff, mask=m4, other=0)
    b_hi = tl.load(data + boff + 4, mask=m4, other=0)
    lo, hi, s = _values(b_lo, b_hi, sbits, dec)
    return lo, hi, s, dec


@triton.jit
def _read_v(x, s, dec, est):
    """v from its dequantized stored form: zeros lifted to the block floor (state_transforms.
    block_floor), squared, times the rank-1 estimate."""
    floor = (0.5 * tl.where(s == 0, _ZERO_SCALE_BOUND, s)) * dec
    r = tl.where(x == 0, floor, x)
    return (r * r) * est


@triton.jit
def _safe_div(x, d):
    pos = d > 0
    return tl.where(pos, tl.math.div_rn(x, tl.where(pos, d, 1.0)), 0.0)


@triton.jit
def _keys(seed_hash, index, step, moment: tl.constexpr):
    """seed_keys(state_seed(seed, index, step, moment)) of optim/adamw4.py, on uint32."""
    h = seed_hash.to(tl.uint32)
    h = jit.lowbias32(h ^ jit.lowbias32(index))
    h = jit.lowbias32(h ^ jit.lowbias32(step))
    h = jit.lowbias32(h ^ jit.lowbias32(tl.full((), moment, tl.uint32)))
    k1 = jit.lowbias32(h)
    return k1, jit.lowbias32(k1 ^ tl.full((), _SALT, tl.uint32))


@triton.jit
def _quantize(lo, hi, amax, eoff, k1, k2):
    """Codes (lo, hi) and E4M3 scale bits of one tile, as formats/nvfp4.quantize with
    stochastic rounding and a given amax (no padding: K is a multiple of 16)."""
    s_enc, s_dec = jit.global_scales(amax, 448.0)
    sbits = jit.block_scale_bits(jit.block_amax(lo, hi), s_enc, 1.0 / 6.0)
    enc = jit.encode_factor(sbits, s_dec)[:, :, None]
    code_lo = jit.round_half(lo * enc, _uniform(eoff, k1, k2), True)
    code_hi = jit.round_half(hi * enc, _uniform(eoff + 8, k1, k2), True)
    return code_lo, code_hi, sbits


@triton.jit
def _store_codes(data, scales, boff, soff, m4, bmask, code_lo, code_hi, sbits):
    nan_block = (sbits == 0x7F)[:, :, None]  # the reference's codes there are all 0
    tl.store(data + boff, tl.where(nan_block, 0, jit.pack_pairs(code_lo)), mask=m4)
    tl.store(data + boff + 4, tl.where(nan_block, 0, jit.pack_pairs(code_hi)), mask=m4)
    tl.store(scales + soff, sbits.to(tl.uint8), mask=bmask)


@triton.jit
def _tile_max(lo, hi):
    return tl.reduce(tl.reduce(jit.block_amax(lo, hi), 1, jit.max_nan), 0, jit.max_nan)


@triton.jit(do_not_specialize=["seed_hash", "step"])
def adamw4_kernel(
    work_ptr, meta_ptr, grad_ptrs, scratch_ptr, keep_ptr, vnew_ptr,
    decay, w1, beta2, w2, bc2, eps, neg_step, seed_hash, step,
    PASS: tl.constexpr, DECAY: tl.constexpr, BM: tl.constexpr, KB: tl.constexpr,
    KEEP: tl.constexpr,
):
    """One pass (0-3, see the module docstring) over one tile of one tensor. vnew_ptr: the
    transient buffer of the new v's codes and block scales (pass 2 writes them, pass 3 copies
    them into the state). KEEP: pass 0 writes the new v and m in float32 to keep_ptr, and the
    later passes read them there instead of recomputing them."""
    pid = tl.program_id(0)
    t = tl.load(work_ptr + pid)
    meta = meta_ptr + t * NMETA
    # int32 offsets (the host fuses tensors of < 2**31 elements only); K is a multiple of 16.
    R = tl.load(meta + _ROWS).to(tl.int32)
    K = tl.multiple_of(tl.load(meta + _COLS).to(tl.int32), 16)
    tile = (pid - tl.load(meta + _TILE0)).to(tl.int32)
    col_tiles = tl.load(meta + _COL_TILES).to(tl.int32)
    tr = tile // col_tiles
    tc = tile % col_tiles
    rows = tr * BM + tl.arange(0, BM)
    kbs = tc * KB + tl.arange(0, KB)
    row_ok = rows < R
    bmask = row_ok[:, None] & (kbs < K // 16)[None, :]
    m8 = bmask[:, :, None] & (tl.arange(0, 8) < 8)[None, None, :]
    m4 = bmask[:, :, None] & (tl.arange(0, 4) < 4)[None, None, :]
    col = kbs[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]  # [1, KB, 8]: lo columns
    eoff = rows[:, None, None] * K + col  # element offsets (lo; hi is +8)
    boff = rows[:, None, None] * (K // 2) + kbs[None, :, None] * 8 + tl.arange(0, 4)[None, None, :]
    soff = rows[:, None] * (K // 16) + kbs[None, :]
    sums = scratch_ptr + tl.load(meta + _SCRATCH)
    amaxes = (sums + R + K + 1).to(tl.pointer_type(tl.float32))  # [0]: stored v, [1]: m

    keep_v = tl.multiple_of(keep_ptr + tl.load(meta + _ELEM0) * 2, 16)  # v, m: R * K each
    keep_m = tl.multiple_of(keep_v + R * K, 16)
    if PASS == 0 or not KEEP:
        # The new v and m, from the gradient and the old states.
        gp = tl.multiple_of(tl.load(grad_ptrs + t).to(tl.pointer_type(tl.float32)), 16)
        g_lo = tl.load(gp + eoff, mask=m8, other=0.0)
        g_hi = tl.load(gp + eoff + 8, mask=m8, other=0.0)
        x_lo, x_hi, s, dec = _decode(meta, _OLD + _VD, boff, soff, m4, bmask)
        row_old = tl.load(_field(meta, _OLD + _ROW, tl.float32) + rows, mask=row_ok, other=0.0)
        col_ptr = _field(meta, _OLD + _COL, tl.float32)
        est_lo = row_old[:, None, None] * tl.load(col_ptr + col, mask=col < K, other=0.0)
        est_hi = row_old[:, None, None] * tl.load(col_ptr + col + 8, mask=col < K, other=0.0)
        v_lo = _read_v(x_lo, s, dec, est_lo)
        v_hi = _read_v(x_hi, s, dec, est_hi)
        if PASS != 1:  # pass 1 needs only v
            m_lo, m_hi, _, _ = _decode(meta, _OLD, boff, soff, m4, bmask)
            m_lo = m_lo * tl.sqrt_rn(v_lo)  # stored normalized: m = m_hat * sqrt(v)
            m_hi = m_hi * tl.sqrt_rn(v_hi)
            m_lo = m_lo + (g_lo - m_lo) * w1
            m_hi = m_hi + (g_hi - m_hi) * w1
        v_lo = v_lo * beta2 + (g_lo * w2) * g_lo
        v_hi = v_hi * beta2 + (g_hi * w2) * g_hi
        if KEEP:
            tl.store(keep_v + eoff, v_lo, mask=m8)
            tl.store(keep_v + eoff + 8, v_hi, mask=m8)
            tl.store(keep_m + eoff, m_lo, mask=m8)
            tl.store(keep_m + eoff + 8, m_hi, mask=m8)
    else:
        v_lo = tl.load(keep_v + eoff, mask=m8, other=0.0)
        v_hi = tl.load(keep_v + eoff + 8, mask=m8, other=0.0)
        if PASS != 1:
            m_lo = tl.load(keep_m + eoff, mask=m8, other=0.0)
            m_hi = tl.load(keep_m + eoff + 8, mask=m8, other=0.0)

    if PASS == 0:
        pp = _field(meta, _P, tl.float32)
        p_lo = tl.load(pp + eoff, mask=m8, other=0.0)
        p_hi = tl.load(pp + eoff + 8, mask=m8, other=0.0)
        if DECAY:
            p_lo = p_lo * decay
            p_hi = p_hi * decay
        d_lo = tl.math.div_rn(tl.sqrt_rn(v_lo), bc2) + eps
        d_hi = tl.math.div_rn(tl.sqrt_rn(v_hi), bc2) + eps
        tl.store(pp + eoff, p_lo + tl.math.div_rn(m_lo * neg_step, d_lo), mask=m8)
        tl.store(pp + eoff + 8, p_hi + tl.math.div_rn(m_hi * neg_step, d_hi), mask=m8)
        # float64 sums of v for the rank-1 factors (state_transforms.rank1_factors).
        v64_lo = tl.where(m8, v_lo, 0.0).to(tl.float64)
        v64_hi = tl.where(m8, v_hi, 0.0).to(tl.float64)
        rsum = tl.sum(tl.sum(v64_lo, 2), 1) + tl.sum(tl.sum(v64_hi, 2), 1)
        tl.atomic_add(sums + rows, rsum, mask=row_ok)
        tl.atomic_add(sums + R + col, tl.sum(v64_lo, 0)[None, :, :], mask=col < K)
        tl.atomic_add(sums + R + col + 8, tl.sum(v64_hi, 0)[None, :, :], mask=col < K)
        tl.atomic_add(sums + R + K, tl.sum(rsum, 0))
    else:
        if PASS == 1:
            # Row means over the total mean and column means, float64 as rank1_factors.
            total = tl.load(sums + R + K) * (1.0 / (R * K).to(tl.float64))
            inv_total = 1.0 / tl.where(total > 0, total, 1.0)
            rs = tl.load(sums + rows, mask=row_ok, other=0.0)
            row = ((rs * (1.0 / K.to(tl.float64))) * inv_total).to(tl.float32)
            inv_r = 1.0 / R.to(tl.float64)
            col_lo = (tl.load(sums + R + col, mask=col < K, other=0.0) * inv_r).to(tl.float32)
            col_hi = (tl.load(sums + R + col + 8, mask=col < K, other=0.0) * inv_r).to(tl.float32)
            if tc == 0:
                tl.store(_field(meta, _NEW + _NROW, tl.float32) + rows, row, mask=row_ok)
            if tr == 0:
                col_new = _field(meta, _NEW + _NCOL, tl.float32)
                tl.store(col_new + col, col_lo, mask=col < K)
                tl.store(col_new + col + 8, col_hi, mask=col < K)
        else:
            row = tl.load(_field(meta, _NEW + _NROW, tl.float32) + rows, mask=row_ok,
                          other=0.0)
            col_new = _field(meta, _NEW + _NCOL, tl.float32)
            col_lo = tl.load(col_new + col, mask=col < K, other=0.0)
            col_hi = tl.load(col_new + col + 8, mask=col < K, other=0.0)
        est_lo = row[:, None, None] * col_lo
        est_hi = row[:, None, None] * col_hi
        st_lo = tl.where(m8, tl.sqrt_rn(_safe_div(v_lo, est_lo)), 0.0)
        st_hi = tl.where(m8, tl.sqrt_rn(_safe_div(v_hi, est_hi)), 0.0)
        if PASS == 1:
            tl.atomic_max(amaxes, _tile_max(st_lo, st_hi))
        else:
            index = (tl.load(meta + _INDEX) & 0xFFFFFFFF).to(tl.uint32)
            step32 = step.to(tl.uint32)
            amax_v = tl.load(amaxes)
            dec_new = amax_v * _DEC
            # The new v's codes and block scales, in the transient buffer until pass 3 has read
            # the old ones.
            vnew_data = tl.multiple_of(vnew_ptr + tl.load(meta + _VDATA), 16)
            vnew_scales = tl.multiple_of(vnew_ptr + tl.load(meta + _VSCALES), 16)
            if PASS == 2:
                k1, k2 = _keys(seed_hash, index, step32, 1)
                c_lo, c_hi, sbits = _quantize(st_lo, st_hi, amax_v, eoff, k1, k2)
                _store_codes(vnew_data, vnew_scales, boff, soff, m4, bmask, c_lo, c_hi, sbits)
                if tile == 0:
                    tl.store(_field(meta, _NEW + _NVA, tl.float32), amax_v)
                s_new = jit.e4m3_value(sbits)[:, :, None]
                x_lo = (jit.e2m1_value(c_lo) * s_new) * dec_new
                x_hi = (jit.e2m1_value(c_hi) * s_new) * dec_new
            else:
                vb_lo = tl.load(vnew_data + boff, mask=m4, other=0)
                vb_hi = tl.load(vnew_data + boff + 4, mask=m4, other=0)
                vsbits = tl.load(vnew_scales + soff, mask=bmask, other=0)
                x_lo, x_hi, s_new = _values(vb_lo, vb_hi, vsbits, dec_new)
            # m over the sqrt of the v the next step reads back, so m round-trips exactly.
            n_lo = tl.where(m8, _safe_div(m_lo, tl.sqrt_rn(_read_v(x_lo, s_new, dec_new,
                                                                     est_lo))), 0.0)
            n_hi = tl.where(m8, _safe_div(m_hi, tl.sqrt_rn(_read_v(x_hi, s_new, dec_new,
                                                                     est_hi))), 0.0)
            if PASS == 2:
                tl.atomic_max(amaxes + 1, _tile_max(n_lo, n_hi))
            else:
                amax_m = tl.load(amaxes + 1)
                k1, k2 = _keys(seed_hash, index, step32, 0)
                c_lo, c_hi, sbits = _quantize(n_lo, n_hi, amax_m, eoff, k1, k2)
                # The new m and v replace the old ones in place: this tile's codes and block
                # scales are read by this program only (the block floor of v uses the scale of
                # its own block), and past the barrier every thread of it has read them.
                tl.debug_barrier()
                _store_codes(_field(meta, _OLD + _MD, tl.uint8), _field(meta, _OLD + _MS, tl.uint8),
                             boff, soff, m4, bmask, c_lo, c_hi, sbits)
                vd = _field(meta, _OLD + _VD, tl.uint8)
                tl.store(vd + boff, vb_lo, mask=m4)
                tl.store(vd + boff + 4, vb_hi, mask=m4)
                tl.store(_field(meta, _OLD + _VS, tl.uint8) + soff, vsbits, mask=bmask)
                if tile == 0:
                    tl.store(_field(meta, _NEW + _NMA, tl.float32), amax_m)


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


class _Plan:
    """Device tables of one set of tensors (kept alive here, so the pointers stay valid), and
    the sizes of the buffers each step allocates for itself."""

    def __init__(self, params: list[Tensor], states: list[dict], spares: list[dict],
                 indices: list[int]) -> None:
        device = params[0].device
        tiles, table = [], []
        tile0 = scratch = elem0 = vnew = 0
        for p, state, spare, index in zip(params, states, spares, indices, strict=True):
            k = p.shape[-1]
            r = p.numel() // k
            col_tiles = triton.cdiv(k // BLOCK, KB)
            n = triton.cdiv(r, BM) * col_tiles
            tensors = [p, *(state[f] for f in FIELDS), *(spare[f] for f in SMALL)]
            ptrs = [t.data_ptr() for t in tensors]
            if (any(ptr % 16 for ptr in ptrs) or p.numel() >= 2**31
                    or not all(t.is_contiguous() for t in tensors)):
                raise ValueError("the fused AdamW4 step needs contiguous 16-byte aligned tensors "
                                 "of fewer than 2**31 elements")
            vdata = vnew
            vscales = vdata + _align16(p.numel() // 2)  # codes: 2 per byte
            vnew = vscales + _align16(p.numel() // BLOCK)  # one E4M3 scale per 16
            table.append([*ptrs, r, k, tile0, col_tiles, scratch, index, elem0, vdata, vscales])
            elem0 += p.numel()
            tiles.append(n)
            tile0 += n
            scratch += r + k + 2  # row sums, column sums, total, the two fp32 amaxes
        self.meta = torch.tensor(table, dtype=torch.int64, device=device)
        self.work = torch.repeat_interleave(
            torch.arange(len(params), dtype=torch.int32), torch.tensor(tiles)).to(device)
        self.device = device
        self.scratch_numel = scratch
        self.vnew_bytes = vnew
        self.numel = elem0
        self.keep = [params, [dict(s) for s in states], [dict(s) for s in spares]]
        self.grad_key: list[int] = []
        self.grad_ptrs: Tensor | None = None


def plan_key(states: list[dict], indices: list[int]) -> tuple:
    """Identifies a plan: the parameters, their state tensors (the codes of m and v; the
    reference step replaces all fields of a moment at once) and which of the two buffer sets
    of SMALL holds the state (the ids of the current tensors, which the plan keeps alive, so
    they are not reused)."""
    return tuple(indices), tuple(id(s["exp_avg_data"]) for s in states), \
        tuple(id(s["exp_avg_sq_data"]) for s in states), \
        tuple(id(s["exp_avg_sq_row"]) for s in states)


def fused_step(
    params: list[Tensor], grads: list[Tensor], states: list[dict], spares: list[dict],
    indices: list[int], step: int, *, lr: float, beta1: float, beta2: float, eps: float,
    weight_decay: float, seed: int, cache: dict,
) -> None:
    """One AdamW4 step of float32 `params` whose states (rank1, NVFP4) have all been stepped
    `step` times including this one; bit-exact with the reference step. The packed codes and
    block scales of m and v are rewritten in place; the new amaxes and rank-1 factors are
    written into `spares` (dicts of tensors shaped like the SMALL fields of `states`), then
    swapped in. Transient buffers (the new v's codes and scales, the float64 sums) are
    allocated for the step and freed when it returns.

    `cache` (owned by the caller) keeps the device tables between steps.
    """
    key = plan_key(states, indices)
    plan = cache.get(key)
    if plan is None:
        if len(cache) >= 8:  # stale plans (another grad pattern, a reload): drop them all
            cache.clear()
        plan = cache[key] = _Plan(params, states, spares, indices)
    # Gradients are often at the same addresses step after step (the caching allocator hands
    # the same blocks back): upload their pointers only when they moved. non_blocking: from
    # pageable memory the copy is staged at once and no stream synchronization happens.
    ptrs = [g.data_ptr() for g in grads]
    if plan.grad_ptrs is None or ptrs != plan.grad_key:
        plan.grad_key = ptrs
        plan.grad_ptrs = torch.tensor(ptrs, dtype=torch.int64).to(plan.device, non_blocking=True)
    scratch = torch.zeros(plan.scratch_numel, dtype=torch.float64, device=plan.device)
    vnew = torch.empty(plan.vnew_bytes, dtype=torch.uint8, device=plan.device)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    seed_hash = lowbias32_int(seed ^ (seed >> 32))
    # KEEP_FP32: new m and v in float32 between the passes, allocated for the step only.
    keep = (torch.empty(2 * plan.numel, dtype=torch.float32, device=plan.device)
            if KEEP_FP32 else scratch)
    args = (plan.work, plan.meta, plan.grad_ptrs, scratch, keep, vnew,
            1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, bias_correction2_sqrt, eps,
            -(lr / bias_correction1), seed_hash - (1 << 32) if seed_hash >= 1 << 31 else seed_hash,
            step)
    grid = (plan.work.numel(),)
    for pass_ in range(4):
        adamw4_kernel[grid](*args, PASS=pass_, DECAY=pass_ == 0 and weight_decay != 0, BM=BM, KB=KB,
                            KEEP=KEEP_FP32, num_warps=NUM_WARPS, **_launch_options())
    for state, spare in zip(states, spares, strict=True):
        old = _get_small(state)
        state.update(spare)
        spare.update(zip(SMALL, old, strict=True))
