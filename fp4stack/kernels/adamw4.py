"""Fused AdamW4 step: every NVFP4-state tensor of a param group in three multi-tensor launches.

Bit-exact with the reference step (fp4stack/optim/adamw4.py, `AdamW4._step_param`) for the
default settings: transform "rank1", stochastic state rounding, first moment stored normalized,
delayed scaling.

With delayed scaling the tensor amaxes of the stored m and v are known before the step
(`headroom` times those of the previous step), so of the reference's global reductions only one
precedes the quantization: the rank-1 factors of the new v. The step takes two passes over the
tensors, the second recomputing from the gradient and the old packed states what the first
computed:

    pass "sums":    the new v; float64 row, column and total sums of it (atomics)
    "factors":      per row and column (not per element): the roots of the new rank-1 factors
                    and their reciprocals, from the sums
    pass "step":    p updated in place; the new v and m quantized (stochastic rounding) with
                    the delayed amaxes, their codes and block scales written over the old ones
                    in place; the amaxes of the stored forms (atomic max) for the next step

The first step of a tensor has no previous amaxes: a "calibrate" pass between "factors" and
"step" takes them from the step's own v and m (as the reference does).

Memory. Each program of the step pass reads the old codes and block scales of its own tile only
(the block floor of v uses the scale of the same block), so after a barrier it overwrites them
with the new ones. The small fields every program reads the old values of (the fp32 amaxes, the
next amaxes, the roots of the rank-1 factors) are double-buffered: the new ones go to spares
(`spares`, 16 bytes per tensor and 4 per row and per column), swapped with the states at the end
of the step. Resident between steps: the states (1.125 bytes per parameter, 4 per row and
column), these spares and the launch tables (8 x NMETA bytes and a gradient pointer per tensor,
4 bytes per tile of 1024 elements and per line of 1024 rows or columns). Transient, allocated
for the step: float64 sums and float32 reciprocal roots (12 bytes per row and per column).

One launch covers all tensors: a table of per-tensor pointers and sizes (`meta`), a work list
mapping each program to its tensor, tiles of BM rows x KB 16-element blocks. Per-step scalars
(learning rate, bias corrections, the step for the rounding seeds) are kernel arguments, so
tensors are launched together only when their step counts agree (the caller groups them).
Bytes per parameter and step: gradient 4 x 2, parameter 8 (read and write), old packed v
0.5625 x 2 and m 0.5625, the new m and v 1.125 written: about 18.8, against 28 for torch's
fused AdamW (fp32 p, grad, m, v). Square roots and divisions are exact (sqrt.rn / div.rn,
several instructions each, as bit-exactness needs): three per element (sqrt(v), the update,
m over the root of v read back); the rank-1 transform needs none of its own (see
optim/state_transforms.py).
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

# Tile of one program of the step and calibrate passes: BM rows x KB blocks of 16 (1024
# elements), and its warps; and of the sums pass, whose column sums are atomics per tile (fewer,
# larger tiles: fewer atomics and cross-thread reductions per element).
BM = 8
KB = 8
NUM_WARPS = 4
SUMS_BM = 32
SUMS_KB = 8
SUMS_WARPS = 4
# Rows and columns per program of the factors launch.
LINE = 1024

# The state fields the fused step reads and rewrites (all of a quantized "rank1" parameter's
# tensors).
FIELDS = ("exp_avg_data", "exp_avg_scales", "exp_avg_amax", "exp_avg_next_amax",
          "exp_avg_sq_data", "exp_avg_sq_scales", "exp_avg_sq_amax", "exp_avg_sq_next_amax",
          "exp_avg_sq_row", "exp_avg_sq_col")
# The fields every program reads the old values of while the new ones are written:
# double-buffered, the new values written into spares of these (`spares`), swapped with the
# states after the step. The packed codes and block scales are rewritten in place.
SMALL = ("exp_avg_amax", "exp_avg_next_amax", "exp_avg_sq_amax", "exp_avg_sq_next_amax",
         "exp_avg_sq_row", "exp_avg_sq_col")

_get_small = operator.itemgetter(*SMALL)

# Columns of the per-tensor table: the parameter, the state fields, the spares of SMALL, then
# sizes and offsets (tl.constexpr: the kernel reads them as compile-time constants).
_P = tl.constexpr(0)
_OLD = tl.constexpr(1)
_NEW = tl.constexpr(1 + len(FIELDS))
_ROWS = tl.constexpr(1 + len(FIELDS) + len(SMALL))
_COLS = tl.constexpr(_ROWS + 1)
_SCRATCH = tl.constexpr(_ROWS + 2)  # offset of its sums (and reciprocal roots) in the scratch
_INDEX = tl.constexpr(_ROWS + 3)  # the parameter's index in the optimizer (rounding seeds)
_LINE0 = tl.constexpr(_ROWS + 4)  # first program of this tensor in the line work list
# First program of this tensor in a tile work list and its tiles per row of tiles: for the
# step tiles, then for the sums tiles.
_TILE0 = tl.constexpr(_ROWS + 5)
_COL_TILES = tl.constexpr(_ROWS + 6)
NMETA = tl.constexpr(_ROWS + 9)
# Field offsets inside the state group, in the order of FIELDS, and inside the spare group, in
# the order of SMALL.
_MD, _MS, _MA, _MN, _VD, _VS, _VA, _VN, _ROW, _COL = (tl.constexpr(i) for i in range(10))
_NMA, _NMN, _NVA, _NVN, _NROW, _NCOL = (tl.constexpr(i) for i in range(6))

# Passes of adamw4_kernel (the host passes their .value).
SUMS, CALIBRATE, STEP = (tl.constexpr(i) for i in range(3))

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
def _root_read(x, s, dec, est_root):
    """The root of v from its dequantized stored form: zeros lifted to the block floor
    (state_transforms.block_floor), times the root of the rank-1 estimate (read_state)."""
    floor = (0.5 * tl.where(s == 0, _ZERO_SCALE_BOUND, s)) * dec
    return tl.where(x == 0, floor, x) * est_root


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
def _next_amax(meta, col, lo, hi, headroom):
    """Raise the amax field at table column `col` to headroom x this tile's amax."""
    tile_max = tl.reduce(tl.reduce(jit.block_amax(lo, hi), 1, jit.max_nan), 0, jit.max_nan)
    tl.atomic_max(_field(meta, col, tl.float32), tile_max * headroom)


@triton.jit
def _pair(ptr, col, K):
    """A [1, KB, 8] row vector at columns col and col + 8 (lo and hi half-blocks)."""
    return (tl.load(ptr + col, mask=col < K, other=0.0),
            tl.load(ptr + col + 8, mask=col < K, other=0.0))


@triton.jit(do_not_specialize=["seed_hash", "step"])
def adamw4_kernel(
    work_ptr, meta_ptr, grad_ptrs, sums_ptr, inv_ptr,
    decay, w1, beta2, w2, inv_bc2, eps, neg_step, headroom, seed_hash, step,
    PASS: tl.constexpr, DECAY: tl.constexpr, BM: tl.constexpr, KB: tl.constexpr,
):
    """One pass (SUMS, CALIBRATE or STEP, see the module docstring) over one tile of one tensor.
    sums_ptr: float64 row, column and total sums of the new v per tensor; inv_ptr: float32
    reciprocal roots of the new rank-1 factors, rows then columns, at the same offsets."""
    pid = tl.program_id(0)
    t = tl.load(work_ptr + pid)
    meta = meta_ptr + t * NMETA
    # int32 offsets (the host fuses tensors of < 2**31 elements only); K is a multiple of 16.
    R = tl.load(meta + _ROWS).to(tl.int32)
    K = tl.multiple_of(tl.load(meta + _COLS).to(tl.int32), 16)
    tiling = meta + (2 if PASS == SUMS else 0)  # the sums pass's tiles, or the others'
    tile = (pid - tl.load(tiling + _TILE0)).to(tl.int32)
    col_tiles = tl.load(tiling + _COL_TILES).to(tl.int32)
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
    scratch = tl.load(meta + _SCRATCH)

    # The new v (and m), from the gradient and the old states.
    gp = tl.multiple_of(tl.load(grad_ptrs + t).to(tl.pointer_type(tl.float32)), 16)
    g_lo = tl.load(gp + eoff, mask=m8, other=0.0)
    g_hi = tl.load(gp + eoff + 8, mask=m8, other=0.0)
    x_lo, x_hi, s, dec = _decode(meta, _OLD + _VD, boff, soff, m4, bmask)
    row_old = tl.load(_field(meta, _OLD + _ROW, tl.float32) + rows, mask=row_ok, other=0.0)
    col_lo, col_hi = _pair(_field(meta, _OLD + _COL, tl.float32), col, K)
    root_lo = _root_read(x_lo, s, dec, row_old[:, None, None] * col_lo)
    root_hi = _root_read(x_hi, s, dec, row_old[:, None, None] * col_hi)
    v_lo = (root_lo * root_lo) * beta2 + (g_lo * w2) * g_lo
    v_hi = (root_hi * root_hi) * beta2 + (g_hi * w2) * g_hi

    if PASS == SUMS:
        # float64 sums of v for the rank-1 factors (state_transforms.rank1_roots).
        sums = sums_ptr + scratch
        v64_lo = tl.where(m8, v_lo, 0.0).to(tl.float64)
        v64_hi = tl.where(m8, v_hi, 0.0).to(tl.float64)
        rsum = tl.sum(tl.sum(v64_lo, 2), 1) + tl.sum(tl.sum(v64_hi, 2), 1)
        tl.atomic_add(sums + rows, rsum, mask=row_ok)
        tl.atomic_add(sums + R + col, tl.sum(v64_lo, 0)[None, :, :], mask=col < K)
        tl.atomic_add(sums + R + col + 8, tl.sum(v64_hi, 0)[None, :, :], mask=col < K)
        tl.atomic_add(sums + R + K, tl.sum(rsum, 0))
    else:
        m_lo, m_hi, _, _ = _decode(meta, _OLD, boff, soff, m4, bmask)
        m_lo = m_lo * root_lo  # stored normalized: m = m_hat * sqrt(v)
        m_hi = m_hi * root_hi
        m_lo = m_lo + (g_lo - m_lo) * w1
        m_hi = m_hi + (g_hi - m_hi) * w1
        root_lo = tl.sqrt_rn(v_lo)
        root_hi = tl.sqrt_rn(v_hi)
        # The stored form of v: its root times the reciprocal root of the new estimate.
        inv = inv_ptr + scratch
        inv_row = tl.load(inv + rows, mask=row_ok, other=0.0)[:, None, None]
        inv_lo, inv_hi = _pair(inv + R, col, K)
        st_lo = tl.where(m8, root_lo * (inv_row * inv_lo), 0.0)
        st_hi = tl.where(m8, root_hi * (inv_row * inv_hi), 0.0)
        if PASS == CALIBRATE:
            # The first step's amaxes: of stored v, and of m over the root of v as it is.
            _next_amax(meta, _OLD + _VN, st_lo, st_hi, headroom)
            n_lo = tl.where(m8, _safe_div(m_lo, root_lo), 0.0)
            n_hi = tl.where(m8, _safe_div(m_hi, root_hi), 0.0)
            _next_amax(meta, _OLD + _MN, n_lo, n_hi, headroom)
        else:
            pp = _field(meta, _P, tl.float32)
            p_lo = tl.load(pp + eoff, mask=m8, other=0.0)
            p_hi = tl.load(pp + eoff + 8, mask=m8, other=0.0)
            if DECAY:
                p_lo = p_lo * decay
                p_hi = p_hi * decay
            d_lo = root_lo * inv_bc2 + eps
            d_hi = root_hi * inv_bc2 + eps
            tl.store(pp + eoff, p_lo + tl.math.div_rn(m_lo * neg_step, d_lo), mask=m8)
            tl.store(pp + eoff + 8, p_hi + tl.math.div_rn(m_hi * neg_step, d_hi), mask=m8)

            index = (tl.load(meta + _INDEX) & 0xFFFFFFFF).to(tl.uint32)
            step32 = step.to(tl.uint32)
            amax_v = tl.load(_field(meta, _OLD + _VN, tl.float32))
            amax_m = tl.load(_field(meta, _OLD + _MN, tl.float32))
            k1, k2 = _keys(seed_hash, index, step32, 1)
            vc_lo, vc_hi, vsbits = _quantize(st_lo, st_hi, amax_v, eoff, k1, k2)
            # m over the root of the v the next step reads back, so m round-trips exactly.
            row_new = tl.load(_field(meta, _NEW + _NROW, tl.float32) + rows, mask=row_ok,
                              other=0.0)[:, None, None]
            cn_lo, cn_hi = _pair(_field(meta, _NEW + _NCOL, tl.float32), col, K)
            dec_v = amax_v * _DEC
            s_v = jit.e4m3_value(vsbits)[:, :, None]
            x_lo = (jit.e2m1_value(vc_lo) * s_v) * dec_v
            x_hi = (jit.e2m1_value(vc_hi) * s_v) * dec_v
            n_lo = tl.where(m8, _safe_div(m_lo, _root_read(x_lo, s_v, dec_v, row_new * cn_lo)),
                            0.0)
            n_hi = tl.where(m8, _safe_div(m_hi, _root_read(x_hi, s_v, dec_v, row_new * cn_hi)),
                            0.0)
            k1, k2 = _keys(seed_hash, index, step32, 0)
            mc_lo, mc_hi, msbits = _quantize(n_lo, n_hi, amax_m, eoff, k1, k2)
            # The amaxes the next step encodes with, and the ones this step did.
            _next_amax(meta, _NEW + _NVN, st_lo, st_hi, headroom)
            _next_amax(meta, _NEW + _NMN, n_lo, n_hi, headroom)
            if tile == 0:
                tl.store(_field(meta, _NEW + _NVA, tl.float32), amax_v)
                tl.store(_field(meta, _NEW + _NMA, tl.float32), amax_m)
            # The new m and v replace the old ones in place: this tile's codes and block scales
            # are read by this program only, and past the barrier every thread of it has read
            # them.
            tl.debug_barrier()
            _store_codes(_field(meta, _OLD + _VD, tl.uint8), _field(meta, _OLD + _VS, tl.uint8),
                         boff, soff, m4, bmask, vc_lo, vc_hi, vsbits)
            _store_codes(_field(meta, _OLD + _MD, tl.uint8), _field(meta, _OLD + _MS, tl.uint8),
                         boff, soff, m4, bmask, mc_lo, mc_hi, msbits)


@triton.jit
def adamw4_factors_kernel(work_ptr, meta_ptr, sums_ptr, inv_ptr, LINE: tl.constexpr):
    """Per row and column of one tensor: the roots of the new rank-1 factors (into the spares)
    and their reciprocals (into inv_ptr), from the float64 sums, as state_transforms.rank1_roots.
    The first program of a tensor also zeroes its spare next amaxes for the step pass's atomics."""
    pid = tl.program_id(0)
    t = tl.load(work_ptr + pid)
    meta = meta_ptr + t * NMETA
    R = tl.load(meta + _ROWS)
    K = tl.load(meta + _COLS)
    line = pid - tl.load(meta + _LINE0)
    sums = sums_ptr + tl.load(meta + _SCRATCH)
    j = line * LINE + tl.arange(0, LINE)
    is_row = j < R
    ok = j < R + K
    total = tl.load(sums + R + K) * (1.0 / (R * K).to(tl.float64))
    inv_total = 1.0 / tl.where(total > 0, total, 1.0)
    s = tl.load(sums + j, mask=ok, other=0.0)
    f = tl.where(is_row, (s * (1.0 / K.to(tl.float64))) * inv_total, s * (1.0 / R.to(tl.float64)))
    root = tl.sqrt(f)  # float64: correctly rounded (sqrt.rn.f64)
    inv = tl.where(root > 0, 1.0 / tl.where(root > 0, root, 1.0), 0.0)
    tl.store(inv_ptr + tl.load(meta + _SCRATCH) + j, inv.to(tl.float32), mask=ok)
    tl.store(_field(meta, _NEW + _NROW, tl.float32) + j, root.to(tl.float32), mask=is_row)
    tl.store(_field(meta, _NEW + _NCOL, tl.float32) + (j - R), root.to(tl.float32),
             mask=ok & ~is_row)
    if line == 0:
        tl.store(_field(meta, _NEW + _NVN, tl.float32), 0.0)
        tl.store(_field(meta, _NEW + _NMN, tl.float32), 0.0)


class _Plan:
    """Device tables of one set of tensors (kept alive here, so the pointers stay valid), and
    the size of the scratch each step allocates for itself."""

    def __init__(self, params: list[Tensor], states: list[dict], spares: list[dict],
                 indices: list[int]) -> None:
        device = params[0].device
        self.tilings = _tilings()
        counts: list[list[int]] = [[], [], []]  # step tiles, sums tiles, lines per tensor
        starts = [0, 0, 0]
        table = []
        scratch = 0
        for p, state, spare, index in zip(params, states, spares, indices, strict=True):
            k = p.shape[-1]
            r = p.numel() // k
            tensors = [p, *(state[f] for f in FIELDS), *(spare[f] for f in SMALL)]
            ptrs = [t.data_ptr() for t in tensors]
            if (any(ptr % 16 for ptr in ptrs) or p.numel() >= 2**31
                    or not all(t.is_contiguous() for t in tensors)):
                raise ValueError("the fused AdamW4 step needs contiguous 16-byte aligned tensors "
                                 "of fewer than 2**31 elements")
            col_tiles = [triton.cdiv(k // BLOCK, kb) for _, kb in self.tilings]
            n = [triton.cdiv(r, bm) * c for (bm, _), c in zip(self.tilings, col_tiles,
                                                               strict=True)]
            n.append(triton.cdiv(r + k, LINE))
            table.append([*ptrs, r, k, scratch, index, starts[2],
                          starts[0], col_tiles[0], starts[1], col_tiles[1]])
            for i in range(3):
                counts[i].append(n[i])
                starts[i] += n[i]
            scratch += r + k + 1  # row sums, column sums, the total
        self.meta = torch.tensor(table, dtype=torch.int64, device=device)
        self.work, self.sums_work, self.line_work = (_work_list(c, device) for c in counts)
        self.device = device
        self.scratch_numel = scratch
        self.keep = [params, [dict(s) for s in states], [dict(s) for s in spares]]
        self.grad_key: list[int] = []
        self.grad_ptrs: Tensor | None = None


def _tilings() -> tuple[tuple[int, int], tuple[int, int]]:
    """(rows, blocks) of a tile of the step passes and of the sums pass, as now set."""
    return (BM, KB), (SUMS_BM, SUMS_KB)


def _work_list(counts: list[int], device: torch.device) -> Tensor:
    """Tensor index of each program, for `counts[i]` programs of tensor i."""
    return torch.repeat_interleave(
        torch.arange(len(counts), dtype=torch.int32), torch.tensor(counts)).to(device)


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
    weight_decay: float, headroom: float, seed: int, cache: dict,
) -> None:
    """One AdamW4 step of float32 `params` whose states (rank1, NVFP4, delayed scaling) have
    all been stepped `step` times including this one; bit-exact with the reference step. The
    packed codes and block scales of m and v are rewritten in place; the new amaxes and roots
    of the rank-1 factors are written into `spares` (dicts of tensors shaped like the SMALL
    fields of `states`), then swapped in. The float64 sums and float32 reciprocal roots are
    allocated for the step and freed when it returns.

    `cache` (owned by the caller) keeps the device tables between steps.
    """
    key = plan_key(states, indices)
    plan = cache.get(key)
    if plan is not None and plan.tilings != _tilings():  # the tiles were changed (a sweep)
        plan = None
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
    sums = torch.zeros(plan.scratch_numel, dtype=torch.float64, device=plan.device)
    inv = torch.empty(plan.scratch_numel, dtype=torch.float32, device=plan.device)
    seed_hash = lowbias32_int(seed ^ (seed >> 32))
    args = (plan.work, plan.meta, plan.grad_ptrs, sums, inv,
            1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, 1.0 / (1 - beta2**step) ** 0.5,
            eps, -(lr / (1 - beta1**step)), headroom,
            seed_hash - (1 << 32) if seed_hash >= 1 << 31 else seed_hash, step)
    options = dict(BM=BM, KB=KB, num_warps=NUM_WARPS, **_launch_options())
    grid = (plan.work.numel(),)
    adamw4_kernel[(plan.sums_work.numel(),)](
        plan.sums_work, *args[1:], PASS=SUMS.value, DECAY=False, BM=SUMS_BM, KB=SUMS_KB,
        num_warps=SUMS_WARPS, **_launch_options())
    adamw4_factors_kernel[(plan.line_work.numel(),)](plan.line_work, plan.meta, sums, inv,
                                                     LINE=LINE, **_launch_options())
    if step == 1:  # no previous amaxes: the step's own (see the module docstring)
        adamw4_kernel[grid](*args, PASS=CALIBRATE.value, DECAY=False, **options)
    adamw4_kernel[grid](*args, PASS=STEP.value, DECAY=weight_decay != 0, **options)
    for state, spare in zip(states, spares, strict=True):
        old = _get_small(state)
        state.update(spare)
        spare.update(zip(SMALL, old, strict=True))
