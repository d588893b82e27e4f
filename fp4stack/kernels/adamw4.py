"""Fused AdamW4 step: every NVFP4-state tensor of a param group in two passes over its elements.

Bit-exact with the reference step (fp4stack/optim/adamw4.py, `AdamW4._step_param`) for the
default settings: transform "rank1", stochastic state rounding, first moment stored normalized,
delayed scaling.

With delayed scaling the tensor amaxes of the stored m and v are known before the step
(`headroom` times those of the previous step), so of the reference's global reductions only one
precedes the quantization: the rank-1 factors of the new v. A step is two passes over the
tensors, the second recomputing from the gradient and the old packed states what the first
computed, and two tiny launches per row and column:

    memset          the float64 row, column and total sums of the new v
    pass "sums":    the new v; its sums (adamw4_sums_kernel: a program walks a strip of columns
                    row chunk by row chunk, its column sums in registers, one atomic per column
                    and program; per row chunk one per row)
    "factors":      per row and column: the roots of the new rank-1 factors and their
                    reciprocals, from the sums, into scratch
    pass "step":    p updated in place; v and m quantized (stochastic rounding) with the
                    delayed amaxes, their codes and block scales written over the old ones in
                    place; the amaxes of the stored forms (atomic max into scratch)
    "roll":         the new roots of the factors into the state; per tensor, the amaxes roll
                    over (this step's encoding amaxes become the decoding ones, headroom x the
                    new maxima the next ones)

The first step of a tensor has no previous amaxes: a "calibrate" pass between "factors" and
"step" takes them from the step's own v and m (as the reference does).

Memory. Each program of the step pass reads the old codes and block scales of its own tiles
only (the block floor of v uses the scale of the same block), so after a barrier it overwrites
each tile's with the new ones; the fields that every program reads (amaxes, roots of the
factors) change only in the roll launch, after the pass. Resident between steps, besides the
states: the launch tables (8 x NMETA bytes and a gradient pointer per tensor, 4 bytes per
program of the step pass (2048 elements) and of the sums pass (8192), and per line of 1024
rows or columns), float64 sums and float32 roots and reciprocal roots (16 bytes per row and per
column), and a float32 pair per tensor for the new amaxes.

One launch covers all tensors: a table of per-tensor pointers and sizes (`meta`), a work list
mapping each program to its tensor. A program of the step pass walks STEP_ITERS tiles of BM
rows x KB 16-element blocks down a strip of columns: the column roots, scalars, rounding keys
and table fields are read once for all of them, and the amaxes' maxima reduced once (per tile,
these were a quarter of the pass's instructions). The per-step
scalars (learning rate, bias corrections, the step for the rounding seeds) are read from a
small device buffer, not passed as arguments, so the launches of a step are the same every step
and are captured once as a CUDA graph and replayed (on CUDA, from the third step with the same
tensors: adamw4_step.StepPlan.run); tensors are launched together only when their step counts
agree (the caller groups them). Where every tile is full (EVEN) the passes drop their bounds masks.
Bytes per parameter and step: gradient 4 x 2, parameter 8 (read and write), old packed v
0.5625 x 2 and m 0.5625, the new m and v 1.125 written: about 18.8, against 28 for torch's
fused AdamW (fp32 p, grad, m, v). Square roots and divisions are exact (sqrt.rn / div.rn,
several instructions each, as bit-exactness needs): three per element (sqrt(v), the update,
m over the root of v read back); the rank-1 transform needs none of its own (see
optim/state_transforms.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import nvfp4_jit as jit

# A program of the step and calibrate passes walks STEP_ITERS tiles of BM rows x KB blocks of 16
# down a strip of columns (what the tiles share is read once), with NUM_WARPS warps. The sums
# pass walks SUMS_ITERS chunks of SUMS_BM rows x SUMS_KB blocks (its column sums accumulate in
# registers, so more rows per program mean fewer atomics). Register caps (ptxas's maxnreg; 0:
# none): fewer registers a thread, more warps on an SM to overlap the loads with. Timed on the
# H200 (docs/PERFORMANCE.md).
BM = 8
KB = 2
STEP_ITERS = 8
NUM_WARPS = 1
STEP_MAXNREG = 96
SUMS_BM = 2
SUMS_KB = 8
SUMS_ITERS = 32
SUMS_WARPS = 1
SUMS_MAXNREG = 64
# Rows and columns per program of the factors launch.
LINE = 1024

# The state fields the fused step reads and rewrites (all of a quantized "rank1" parameter's
# tensors with delayed scaling), in the order of the table columns _MD.._COL.
FIELDS = ("exp_avg_data", "exp_avg_scales", "exp_avg_amax", "exp_avg_next_amax",
          "exp_avg_sq_data", "exp_avg_sq_scales", "exp_avg_sq_amax", "exp_avg_sq_next_amax",
          "exp_avg_sq_row", "exp_avg_sq_col")

# Columns of the per-tensor table: the parameter, the state fields, then sizes and offsets
# (tl.constexpr: the kernel reads them as compile-time constants).
_P = tl.constexpr(0)
_MD, _MS, _MA, _MN, _VD, _VS, _VA, _VN, _ROW, _COL = (
    tl.constexpr(_P + 1 + i) for i in range(len(FIELDS)))
_ROWS = tl.constexpr(_P + 1 + len(FIELDS))
_COLS = tl.constexpr(_ROWS + 1)
_SCRATCH = tl.constexpr(_ROWS + 2)  # offset of its sums, roots, reciprocal roots in the scratch
_INDEX = tl.constexpr(_ROWS + 3)  # the parameter's index in the optimizer (rounding seeds)
_LINE0 = tl.constexpr(_ROWS + 4)  # first program of this tensor in the line work list
# First program of this tensor in a tile work list and its tiles per row of tiles: for the
# step tiles, then for the sums tiles.
_TILE0 = tl.constexpr(_ROWS + 5)
_COL_TILES = tl.constexpr(_ROWS + 6)
_PENDING = tl.constexpr(_ROWS + 9)  # offset of its new amaxes (m, v) in the pending buffer
NMETA = tl.constexpr(_ROWS + 10)

# Passes of adamw4_kernel (the host passes their .value), and modes of adamw4_factors_kernel.
CALIBRATE, STEP = (tl.constexpr(i) for i in range(2))
FACTORS, FACTORS_FIRST, ROLL = (tl.constexpr(i) for i in range(3))
# The per-step scalars buffer: float32 values, then int32 ones (`step_scalars`).
_DECAY, _W1, _BETA2, _W2, _INV_BC2, _EPS, _NEG_STEP, _HEADROOM, _SEED, _STEP = (
    tl.constexpr(i) for i in range(10))
NSCALARS = 10

_SALT = tl.constexpr(0x9E3779B9)  # formats/random.SEED_SALT
_DEC = tl.constexpr(1.0 / (6.0 * 448.0))  # decode scale per unit of amax: 1 / (E2M1 x E4M3 max)
_ZERO_SCALE_BOUND = tl.constexpr(12 * 2.0**-10)  # state_transforms._ZERO_SCALE_BOUND


@triton.jit
def _field(meta, col, ty: tl.constexpr):
    # Every pointer in the table is 16-byte aligned (the host checks): vector loads.
    return tl.multiple_of(tl.load(meta + col).to(tl.pointer_type(ty)), 16)


@triton.jit
def _keep(x, mask, EVEN: tl.constexpr):
    """x where mask, else 0 (no mask when every tile is full)."""
    if EVEN:
        return x
    else:
        return tl.where(mask, x, 0.0)


@triton.jit
def _load(ptr, mask):
    """tl.load, masked with 0 for masked-off elements unless mask is None (full tiles)."""
    if mask is None:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=0)


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
    """Codes (lo, hi), E4M3 scale bits and block amaxes of one tile, as formats/nvfp4.quantize
    with stochastic rounding and a given amax (no padding: K is a multiple of 16)."""
    s_enc, s_dec = jit.global_scales(amax, 448.0)
    bmax = jit.block_amax(lo, hi)
    sbits = jit.block_scale_bits(bmax, s_enc, 1.0 / 6.0)
    enc = jit.encode_factor(sbits, s_dec)[:, :, None]
    code_lo = jit.round_half(lo * enc, _uniform(eoff, k1, k2), True)
    code_hi = jit.round_half(hi * enc, _uniform(eoff + 8, k1, k2), True)
    return code_lo, code_hi, sbits, bmax


@triton.jit
def _store_codes(data, scales, boff, soff, m4, bmask, code_lo, code_hi, sbits):
    nan_block = (sbits == 0x7F)[:, :, None]  # the reference's codes there are all 0
    tl.store(data + boff, tl.where(nan_block, 0, jit.pack_pairs(code_lo)), mask=m4)
    tl.store(data + boff + 4, tl.where(nan_block, 0, jit.pack_pairs(code_hi)), mask=m4)
    tl.store(scales + soff, sbits.to(tl.uint8), mask=bmask)


@triton.jit
def _max_into(ptr, bmax):
    """Raise *ptr to the largest of this tile's block amaxes [BM, KB]."""
    tl.atomic_max(ptr, jit.abs_max(jit.abs_max(bmax, 1), 0),
                  sem="relaxed")


@triton.jit
def _pair(ptr, col, mask):
    """A [1, KB, 8] row vector at columns col and col + 8 (lo and hi half-blocks)."""
    return _load(ptr + col, mask), _load(ptr + col + 8, mask)


@triton.jit
def _offsets(rows, kbs, K):
    """Offsets in the tile rows x blocks kbs: lo columns [1, KB, 8], elements, bytes of the
    codes, block scales."""
    col = kbs[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]
    eoff = rows[:, None, None] * K + col  # element offsets (lo; hi is +8)
    boff = rows[:, None, None] * (K // 2) + kbs[None, :, None] * 8 + tl.arange(0, 4)[None, None, :]
    soff = rows[:, None] * (K // 16) + kbs[None, :]
    return col, eoff, boff, soff


@triton.jit
def _masks(rows, kbs, col, R, K):
    """Masks of a partial tile: rows, columns, blocks, elements (lo), code bytes."""
    row_ok = rows < R
    bmask = row_ok[:, None] & (kbs < K // 16)[None, :]
    m8 = bmask[:, :, None] & (tl.arange(0, 8) < 8)[None, None, :]
    m4 = bmask[:, :, None] & (tl.arange(0, 4) < 4)[None, None, :]
    return row_ok, col < K, bmask, m8, m4


@triton.jit
def _v_loads(gp, vd, vs, row_root, rows, eoff, boff, soff, row_ok, bmask, m8, m4):
    """What the new v of a tile reads, row by row: the gradient (lo, hi), the old v's code bytes
    (lo, hi) and block scale bits (from its fields vd, vs), its old row roots."""
    g_lo = _load(gp + eoff, m8)
    g_hi = _load(gp + eoff + 8, m8)
    b_lo = _load(vd + boff, m4)
    b_hi = _load(vd + boff + 4, m4)
    sbits = _load(vs + soff, bmask)
    row_old = _load(row_root + rows, row_ok)
    return g_lo, g_hi, b_lo, b_hi, sbits, row_old


@triton.jit
def _v_from(g_lo, g_hi, b_lo, b_hi, sbits, row_old, col_lo, col_hi, dec, beta2, w2, m8,
            EVEN: tl.constexpr):
    """The new v of a tile (lo, hi; 0 where masked) from _v_loads's values, the old column
    roots and the old v's decode scale; and the roots of the old v as read back."""
    x_lo, x_hi, s = _values(b_lo, b_hi, sbits, dec)
    root_lo = _root_read(x_lo, s, dec, row_old[:, None, None] * col_lo)
    root_hi = _root_read(x_hi, s, dec, row_old[:, None, None] * col_hi)
    v_lo = _keep((root_lo * root_lo) * beta2 + (g_lo * w2) * g_lo, m8, EVEN)
    v_hi = _keep((root_hi * root_hi) * beta2 + (g_hi * w2) * g_hi, m8, EVEN)
    return v_lo, v_hi, root_lo, root_hi


@triton.jit
def _program(work_ptr, meta_ptr, TILING: tl.constexpr):
    """This program's tensor (its index and table row), the tensor's rows and columns, and the
    row and column of the program's tile in it (TILING 0: the step tiles, 2: the sums pass's).
    int32 offsets: the host fuses tensors of < 2**31 elements only; K is a multiple of 16."""
    pid = tl.program_id(0)
    t = tl.load(work_ptr + pid)
    meta = meta_ptr + t * NMETA
    R = tl.load(meta + _ROWS).to(tl.int32)
    K = tl.multiple_of(tl.load(meta + _COLS).to(tl.int32), 16)
    tile = (pid - tl.load(meta + _TILE0 + TILING)).to(tl.int32)
    col_tiles = tl.load(meta + _COL_TILES + TILING).to(tl.int32)
    return t, meta, R, K, tile // col_tiles, tile % col_tiles


@triton.jit
def adamw4_sums_kernel(work_ptr, meta_ptr, grad_ptrs, scal_ptr, sums_ptr, EVEN: tl.constexpr,
                       BM: tl.constexpr, KB: tl.constexpr, ITERS: tl.constexpr):
    """Pass "sums": the new v of ITERS x BM rows x KB blocks of one tensor, added into its
    float64 row, column and total sums (state_transforms.rank1_roots). The column sums build up
    element-wise in registers over the rows and cross threads and go out once per program: per
    element, one conversion and two float64 adds, and few atomics. Each chunk of rows loads the
    next one's inputs before its arithmetic, so the loads overlap it."""
    t, meta, R, K, tr, tc = _program(work_ptr, meta_ptr, 2)
    kbs = tc * KB + tl.arange(0, KB)
    sums = sums_ptr + tl.load(meta + _SCRATCH)
    gp = tl.multiple_of(tl.load(grad_ptrs + t).to(tl.pointer_type(tl.float32)), 16)
    beta2 = tl.load(scal_ptr + _BETA2)
    w2 = tl.load(scal_ptr + _W2)
    dec = tl.load(_field(meta, _VA, tl.float32)) * _DEC
    rows = tr * ITERS * BM + tl.arange(0, BM)
    col, eoff, boff, soff = _offsets(rows, kbs, K)
    if EVEN:  # no masks (Triton functions cannot return None)
        row_ok, col_ok, bmask, m8, m4 = None, None, None, None, None
    else:
        row_ok, col_ok, bmask, m8, m4 = _masks(rows, kbs, col, R, K)
    col_lo, col_hi = _pair(_field(meta, _COL, tl.float32), col, col_ok)
    # The fields' pointers, loaded once (in the loop they would be reloaded: atomics intervene).
    vd = _field(meta, _VD, tl.uint8)
    vs = _field(meta, _VS, tl.uint8)
    row_root = _field(meta, _ROW, tl.float32)
    g_lo, g_hi, b_lo, b_hi, sbits, row_old = _v_loads(gp, vd, vs, row_root, rows, eoff, boff,
                                                      soff, row_ok, bmask, m8, m4)
    acc_lo = tl.zeros((BM, KB, 8), tl.float64)
    acc_hi = tl.zeros((BM, KB, 8), tl.float64)
    for _ in range(ITERS):
        # The next chunk's loads (past the last row: the last row again, unused).
        rows_next = tl.minimum(rows + BM, R - 1)
        _, eoff_n, boff_n, soff_n = _offsets(rows_next, kbs, K)
        if EVEN:
            next_ok, bmask_n, m8_n, m4_n = None, None, None, None
        else:
            next_ok, _, bmask_n, m8_n, m4_n = _masks(rows_next, kbs, col, R, K)
        loads = _v_loads(gp, vd, vs, row_root, rows_next, eoff_n, boff_n, soff_n, next_ok,
                         bmask_n, m8_n, m4_n)
        v_lo, v_hi, _, _ = _v_from(g_lo, g_hi, b_lo, b_hi, sbits, row_old, col_lo, col_hi, dec,
                                   beta2, w2, m8, EVEN)
        v64_lo = v_lo.to(tl.float64)
        v64_hi = v_hi.to(tl.float64)
        tl.atomic_add(sums + rows, tl.sum(tl.sum(v64_lo, 2), 1) + tl.sum(tl.sum(v64_hi, 2), 1),
                      mask=row_ok, sem="relaxed")
        acc_lo += v64_lo
        acc_hi += v64_hi
        g_lo, g_hi, b_lo, b_hi, sbits, row_old = loads
        rows = rows + BM
        if not EVEN:
            row_ok, _, bmask, m8, m4 = _masks(rows, kbs, col, R, K)
    csum_lo = tl.sum(acc_lo, 0)[None, :, :]
    csum_hi = tl.sum(acc_hi, 0)[None, :, :]
    tl.atomic_add(sums + R + col, csum_lo, mask=col_ok, sem="relaxed")
    tl.atomic_add(sums + R + col + 8, csum_hi, mask=col_ok, sem="relaxed")
    tl.atomic_add(sums + R + K, tl.sum(tl.sum(tl.sum(csum_lo + csum_hi, 2), 1), 0),
                  sem="relaxed")


@triton.jit
def adamw4_kernel(
    work_ptr, meta_ptr, grad_ptrs, scal_ptr, iscal_ptr, roots_ptr, inv_ptr, pending_ptr,
    PASS: tl.constexpr, DECAY: tl.constexpr, EVEN: tl.constexpr, BM: tl.constexpr,
    KB: tl.constexpr, ITERS: tl.constexpr,
):
    """Pass CALIBRATE or STEP (see the module docstring) over ITERS tiles of BM rows x KB
    blocks of one tensor, one under the other: what the tiles share (the column roots, the
    scalars, the rounding keys, the table) is read once. scal_ptr / iscal_ptr: the step's
    float32 / int32 scalars (one buffer); roots_ptr, inv_ptr: float32 roots of the new v's
    rank-1 factors and their reciprocals, rows then columns, at the tensor's scratch offset;
    pending_ptr: the new amaxes of the stored m and v per tensor. EVEN: every tile is full (no
    masks)."""
    t, meta, R, K, tr, tc = _program(work_ptr, meta_ptr, 0)
    rows = tr * (ITERS * BM) + tl.arange(0, BM)
    kbs = tc * KB + tl.arange(0, KB)
    col, eoff, boff, soff = _offsets(rows, kbs, K)
    col_ok = None if EVEN else col < K
    scratch = tl.load(meta + _SCRATCH)
    inv = inv_ptr + scratch
    roots = roots_ptr + scratch
    # What every tile of the program reads: pointers, scalars, column roots, decode scales.
    gp = tl.multiple_of(tl.load(grad_ptrs + t).to(tl.pointer_type(tl.float32)), 16)
    pp = _field(meta, _P, tl.float32)
    vd = _field(meta, _VD, tl.uint8)
    vs = _field(meta, _VS, tl.uint8)
    md = _field(meta, _MD, tl.uint8)
    ms = _field(meta, _MS, tl.uint8)
    row_root = _field(meta, _ROW, tl.float32)
    col_lo, col_hi = _pair(_field(meta, _COL, tl.float32), col, col_ok)
    inv_lo, inv_hi = _pair(inv + R, col, col_ok)
    dec = tl.load(_field(meta, _VA, tl.float32)) * _DEC
    dec_m = tl.load(_field(meta, _MA, tl.float32)) * _DEC
    beta2 = tl.load(scal_ptr + _BETA2)
    w2 = tl.load(scal_ptr + _W2)
    headroom = tl.load(scal_ptr + _HEADROOM)
    w1 = tl.load(scal_ptr + _W1)
    if PASS == STEP:
        cn_lo, cn_hi = _pair(roots + R, col, col_ok)
        decay = tl.load(scal_ptr + _DECAY)
        inv_bc2 = tl.load(scal_ptr + _INV_BC2)
        eps = tl.load(scal_ptr + _EPS)
        neg_step = tl.load(scal_ptr + _NEG_STEP)
        index = (tl.load(meta + _INDEX) & 0xFFFFFFFF).to(tl.uint32)
        seed_hash = tl.load(iscal_ptr + _SEED)
        step32 = tl.load(iscal_ptr + _STEP).to(tl.uint32)
        amax_v = tl.load(_field(meta, _VN, tl.float32))
        amax_m = tl.load(_field(meta, _MN, tl.float32))
        dec_v = amax_v * _DEC
        kv1, kv2 = _keys(seed_hash, index, step32, 1)
        km1, km2 = _keys(seed_hash, index, step32, 0)
    # Elementwise maxima over the tiles, reduced once after them.
    vmax_run = tl.zeros((BM, KB), tl.float32)
    mmax_run = tl.zeros((BM, KB), tl.float32)
    for _ in range(ITERS):
        if EVEN:  # no masks (Triton functions cannot return None)
            row_ok, bmask, m8, m4 = None, None, None, None
        else:
            row_ok, _, bmask, m8, m4 = _masks(rows, kbs, col, R, K)
        # The new v, from the gradient and the old states.
        g_lo, g_hi, b_lo, b_hi, sbits, row_old = _v_loads(
            gp, vd, vs, row_root, rows, eoff, boff, soff, row_ok, bmask, m8, m4)
        v_lo, v_hi, root_lo, root_hi = _v_from(
            g_lo, g_hi, b_lo, b_hi, sbits, row_old, col_lo, col_hi, dec, beta2, w2, m8, EVEN)
        m_lo, m_hi, _ = _values(_load(md + boff, m4), _load(md + boff + 4, m4),
                                _load(ms + soff, bmask), dec_m)
        m_lo = m_lo * root_lo  # stored normalized: m = m_hat * sqrt(v)
        m_hi = m_hi * root_hi
        m_lo = m_lo + (g_lo - m_lo) * w1
        m_hi = m_hi + (g_hi - m_hi) * w1
        root_lo = tl.sqrt_rn(v_lo)
        root_hi = tl.sqrt_rn(v_hi)
        # The stored form of v: its root times the reciprocal roots of its new factors.
        inv_row = _load(inv + rows, row_ok)[:, None, None]
        st_lo = _keep(root_lo * (inv_row * inv_lo), m8, EVEN)
        st_hi = _keep(root_hi * (inv_row * inv_hi), m8, EVEN)
        if PASS == CALIBRATE:
            # The first step's amaxes: of stored v, and of m over the root of v as it is.
            vmax_run = jit.max_nan(vmax_run, jit.block_amax(st_lo, st_hi))
            n_lo = _keep(_safe_div(m_lo, root_lo), m8, EVEN)
            n_hi = _keep(_safe_div(m_hi, root_hi), m8, EVEN)
            mmax_run = jit.max_nan(mmax_run, jit.block_amax(n_lo, n_hi))
        else:
            p_lo = _load(pp + eoff, m8)
            p_hi = _load(pp + eoff + 8, m8)
            if DECAY:
                p_lo = p_lo * decay
                p_hi = p_hi * decay
            d_lo = root_lo * inv_bc2 + eps
            d_hi = root_hi * inv_bc2 + eps
            tl.store(pp + eoff, p_lo + tl.math.div_rn(m_lo * neg_step, d_lo), mask=m8)
            tl.store(pp + eoff + 8, p_hi + tl.math.div_rn(m_hi * neg_step, d_hi), mask=m8)
            vc_lo, vc_hi, vsbits, vmax = _quantize(st_lo, st_hi, amax_v, eoff, kv1, kv2)
            # m over the root of the v the next step reads back, so m round-trips exactly.
            row_new = _load(roots + rows, row_ok)[:, None, None]
            s_v = jit.e4m3_value(vsbits)[:, :, None]
            x_lo = (jit.e2m1_value(vc_lo) * s_v) * dec_v
            x_hi = (jit.e2m1_value(vc_hi) * s_v) * dec_v
            n_lo = _keep(_safe_div(m_lo, _root_read(x_lo, s_v, dec_v, row_new * cn_lo)), m8,
                         EVEN)
            n_hi = _keep(_safe_div(m_hi, _root_read(x_hi, s_v, dec_v, row_new * cn_hi)), m8,
                         EVEN)
            mc_lo, mc_hi, msbits, mmax = _quantize(n_lo, n_hi, amax_m, eoff, km1, km2)
            vmax_run = jit.max_nan(vmax_run, vmax)
            mmax_run = jit.max_nan(mmax_run, mmax)
            # The new m and v replace the old ones in place: this tile's codes and block
            # scales are read by this program only, and past the barrier every thread of it
            # has read them.
            tl.debug_barrier()
            _store_codes(vd, vs, boff, soff, m4, bmask, vc_lo, vc_hi, vsbits)
            _store_codes(md, ms, boff, soff, m4, bmask, mc_lo, mc_hi, msbits)
        rows += BM
        eoff += BM * K
        boff += BM * (K // 2)
        soff += BM * (K // 16)
    if PASS == CALIBRATE:
        _max_into(_field(meta, _VN, tl.float32), vmax_run * headroom)
        _max_into(_field(meta, _MN, tl.float32), mmax_run * headroom)
    else:
        # The maxima the next step's amaxes come from (the factors launch rolls them).
        pending = pending_ptr + tl.load(meta + _PENDING)
        _max_into(pending, mmax_run)
        _max_into(pending + 1, vmax_run)


@triton.jit
def adamw4_factors_kernel(work_ptr, meta_ptr, scal_ptr, sums_ptr, roots_ptr, inv_ptr, pending_ptr,
                          MODE: tl.constexpr, LINE: tl.constexpr):
    """Per row and column of one tensor. MODE FACTORS: from the float64 sums of the new v, the
    roots of its rank-1 factors and their reciprocals, into roots_ptr and inv_ptr (rows then
    columns at the tensor's offset), as state_transforms.rank1_roots; FACTORS_FIRST (a first
    step): also zero the next amaxes for the calibrate pass's atomics. MODE ROLL (after the step
    pass): the new roots into the state, and the first program of a tensor rolls its amaxes: the
    next ones (this step's encoding amaxes) become the current ones, headroom x the step's new
    maxima (pending_ptr, then zeroed) the next ones."""
    pid = tl.program_id(0)
    t = tl.load(work_ptr + pid)
    meta = meta_ptr + t * NMETA
    R = tl.load(meta + _ROWS)
    K = tl.load(meta + _COLS)
    line = pid - tl.load(meta + _LINE0)
    scratch = tl.load(meta + _SCRATCH)
    j = line * LINE + tl.arange(0, LINE)
    is_row = j < R
    is_col = (j >= R) & (j < R + K)
    ok = j < R + K
    if MODE == ROLL:
        root = tl.load(roots_ptr + scratch + j, mask=ok, other=0.0)
        tl.store(_field(meta, _ROW, tl.float32) + j, root, mask=is_row)
        tl.store(_field(meta, _COL, tl.float32) + (j - R), root, mask=is_col)
        if line == 0:
            headroom = tl.load(scal_ptr + _HEADROOM)
            pending = pending_ptr + tl.load(meta + _PENDING)
            m_next = _field(meta, _MN, tl.float32)
            v_next = _field(meta, _VN, tl.float32)
            tl.store(_field(meta, _MA, tl.float32), tl.load(m_next))
            tl.store(_field(meta, _VA, tl.float32), tl.load(v_next))
            tl.store(m_next, tl.load(pending) * headroom)
            tl.store(v_next, tl.load(pending + 1) * headroom)
            tl.store(pending, 0.0)
            tl.store(pending + 1, 0.0)
    else:
        sums = sums_ptr + scratch
        total = tl.load(sums + R + K) * (1.0 / (R * K).to(tl.float64))
        inv_total = 1.0 / tl.where(total > 0, total, 1.0)
        s = tl.load(sums + j, mask=ok, other=0.0)
        f = tl.where(is_row, (s * (1.0 / K.to(tl.float64))) * inv_total,
                     s * (1.0 / R.to(tl.float64)))
        root = tl.sqrt(f)  # float64: correctly rounded (sqrt.rn.f64)
        inv = tl.where(root > 0, 1.0 / tl.where(root > 0, root, 1.0), 0.0)
        tl.store(roots_ptr + scratch + j, root.to(tl.float32), mask=ok)
        tl.store(inv_ptr + scratch + j, inv.to(tl.float32), mask=ok)
        if MODE == FACTORS_FIRST and line == 0:
            tl.store(_field(meta, _MN, tl.float32), 0.0)
            tl.store(_field(meta, _VN, tl.float32), 0.0)
