"""Fused AdamW4 step: every NVFP4-state tensor of a param group in two passes over its elements.

Bit-exact with the reference step (optim/adamw4.py, `AdamW4._step_param`) for the default state
format: rank-1 transform, stochastic state rounding, first moment stored normalized, delayed
scaling. With delayed scaling the amaxes of the stored m and v are known before the step
(headroom times those of the previous step), so of the reference's global reductions only one
precedes the quantization: the rank-1 factors of the new v. A step is two passes over the
tensors, the second recomputing from the gradient and the old packed states what the first
computed, and two tiny launches per row and column:

    memset          the float64 row, column and total sums of the new v
    pass "sums":    the new v; its sums (adamw4_sums_kernel)
    "factors":      per row and column: the roots of the new rank-1 factors and their
                    reciprocals, from the sums, into scratch
    pass "step":    p updated in place; v and m quantized (stochastic rounding) with the
                    delayed amaxes, their codes and block scales written over the old ones in
                    place; the amaxes of the stored forms (atomic max into scratch)
    "roll":         the new roots of the factors into the state; per tensor, the amaxes roll
                    over (this step's encoding amaxes become the decoding ones, headroom x the
                    new maxima the next ones)

A tensor's first step has no previous amaxes: a "calibrate" pass between "factors" and "step"
takes them from the step's own v and m (as the reference does).

In place: a program of the step pass reads the old codes and block scales of its own tiles only
(v's block floor uses the scale of the same block), so after a barrier it overwrites them; the
fields every program reads (amaxes, roots of the factors) change only in the roll launch. The
tables and scalars the kernels read are described in kernels/adamw4_layout.py, the per-tile
device functions are in kernels/adamw4_tiles.py, the launches in kernels/adamw4_step.py. Bytes
per parameter and step: about 18.8 (gradient 8, parameter 8, packed states read and written),
against 28 for torch's fused AdamW. Square roots and divisions are exact (sqrt.rn / div.rn),
three per element; the rank-1 transform needs none of its own (optim/state_transforms.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import nvfp4_jit as jit
from .adamw4_layout import (
    CALIBRATE,
    COL,
    COLS,
    FACTORS_FIRST,
    INDEX,
    LINE0,
    MA,
    MD,
    MN,
    MS,
    NMETA,
    PARAM,
    PENDING,
    ROLL,
    ROW,
    ROWS,
    S_BETA2,
    S_DECAY,
    S_EPS,
    S_HEADROOM,
    S_INV_BC2,
    S_NEG_STEP,
    S_SEED,
    S_STEP,
    S_W1,
    S_W2,
    SCRATCH,
    STEP,
    VA,
    VD,
    VN,
    VS,
)
from .adamw4_tiles import (
    field,
    keep,
    keys,
    load,
    masks,
    max_into,
    offsets,
    pair,
    program,
    quantize,
    root_read,
    safe_div,
    store_codes,
    v_from,
    v_loads,
    values,
)

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


@triton.jit
def adamw4_sums_kernel(work_ptr, meta_ptr, grad_ptrs, scal_ptr, sums_ptr, EVEN: tl.constexpr,
                       BM: tl.constexpr, KB: tl.constexpr, ITERS: tl.constexpr):
    """Pass "sums": the new v of ITERS x BM rows x KB blocks of one tensor, added into its
    float64 row, column and total sums (state_transforms.rank1_roots). The column sums build up
    element-wise in registers over the rows and cross threads and go out once per program: per
    element, one conversion and two float64 adds, and few atomics. Each chunk of rows loads the
    next one's inputs before its arithmetic, so the loads overlap it."""
    t, meta, R, K, tr, tc = program(work_ptr, meta_ptr, 2)
    kbs = tc * KB + tl.arange(0, KB)
    sums = sums_ptr + tl.load(meta + SCRATCH)
    gp = tl.multiple_of(tl.load(grad_ptrs + t).to(tl.pointer_type(tl.float32)), 16)
    beta2 = tl.load(scal_ptr + S_BETA2)
    w2 = tl.load(scal_ptr + S_W2)
    dec = jit.global_decode(tl.load(field(meta, VA, tl.float32)), 448.0)
    rows = tr * ITERS * BM + tl.arange(0, BM)
    col, eoff, boff, soff = offsets(rows, kbs, K)
    if EVEN:  # no masks (Triton functions cannot return None)
        row_ok, col_ok, bmask, m8, m4 = None, None, None, None, None
    else:
        row_ok, col_ok, bmask, m8, m4 = masks(rows, kbs, col, R, K)
    col_lo, col_hi = pair(field(meta, COL, tl.float32), col, col_ok)
    # The fields' pointers, loaded once (in the loop they would be reloaded: atomics intervene).
    vd = field(meta, VD, tl.uint8)
    vs = field(meta, VS, tl.uint8)
    row_root = field(meta, ROW, tl.float32)
    g_lo, g_hi, b_lo, b_hi, sbits, row_old = v_loads(gp, vd, vs, row_root, rows, eoff, boff,
                                                      soff, row_ok, bmask, m8, m4)
    acc_lo = tl.zeros((BM, KB, 8), tl.float64)
    acc_hi = tl.zeros((BM, KB, 8), tl.float64)
    for _ in range(ITERS):
        # The next chunk's loads (past the last row: the last row again, unused).
        rows_next = tl.minimum(rows + BM, R - 1)
        _, eoff_n, boff_n, soff_n = offsets(rows_next, kbs, K)
        if EVEN:
            next_ok, bmask_n, m8_n, m4_n = None, None, None, None
        else:
            next_ok, _, bmask_n, m8_n, m4_n = masks(rows_next, kbs, col, R, K)
        loads = v_loads(gp, vd, vs, row_root, rows_next, eoff_n, boff_n, soff_n, next_ok,
                         bmask_n, m8_n, m4_n)
        v_lo, v_hi, _, _ = v_from(g_lo, g_hi, b_lo, b_hi, sbits, row_old, col_lo, col_hi, dec,
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
            row_ok, _, bmask, m8, m4 = masks(rows, kbs, col, R, K)
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
    t, meta, R, K, tr, tc = program(work_ptr, meta_ptr, 0)
    rows = tr * (ITERS * BM) + tl.arange(0, BM)
    kbs = tc * KB + tl.arange(0, KB)
    col, eoff, boff, soff = offsets(rows, kbs, K)
    col_ok = None if EVEN else col < K
    scratch = tl.load(meta + SCRATCH)
    inv = inv_ptr + scratch
    roots = roots_ptr + scratch
    # What every tile of the program reads: pointers, scalars, column roots, decode scales.
    gp = tl.multiple_of(tl.load(grad_ptrs + t).to(tl.pointer_type(tl.float32)), 16)
    pp = field(meta, PARAM, tl.float32)
    vd = field(meta, VD, tl.uint8)
    vs = field(meta, VS, tl.uint8)
    md = field(meta, MD, tl.uint8)
    ms = field(meta, MS, tl.uint8)
    row_root = field(meta, ROW, tl.float32)
    col_lo, col_hi = pair(field(meta, COL, tl.float32), col, col_ok)
    inv_lo, inv_hi = pair(inv + R, col, col_ok)
    dec = jit.global_decode(tl.load(field(meta, VA, tl.float32)), 448.0)
    dec_m = jit.global_decode(tl.load(field(meta, MA, tl.float32)), 448.0)
    beta2 = tl.load(scal_ptr + S_BETA2)
    w2 = tl.load(scal_ptr + S_W2)
    headroom = tl.load(scal_ptr + S_HEADROOM)
    w1 = tl.load(scal_ptr + S_W1)
    if PASS == STEP:
        cn_lo, cn_hi = pair(roots + R, col, col_ok)
        decay = tl.load(scal_ptr + S_DECAY)
        inv_bc2 = tl.load(scal_ptr + S_INV_BC2)
        eps = tl.load(scal_ptr + S_EPS)
        neg_step = tl.load(scal_ptr + S_NEG_STEP)
        index = (tl.load(meta + INDEX) & 0xFFFFFFFF).to(tl.uint32)
        seed_hash = tl.load(iscal_ptr + S_SEED)
        step32 = tl.load(iscal_ptr + S_STEP).to(tl.uint32)
        amax_v = tl.load(field(meta, VN, tl.float32))
        amax_m = tl.load(field(meta, MN, tl.float32))
        dec_v = jit.global_decode(amax_v, 448.0)
        kv1, kv2 = keys(seed_hash, index, step32, 1)
        km1, km2 = keys(seed_hash, index, step32, 0)
    # Elementwise maxima over the tiles, reduced once after them.
    vmax_run = tl.zeros((BM, KB), tl.float32)
    mmax_run = tl.zeros((BM, KB), tl.float32)
    for _ in range(ITERS):
        if EVEN:  # no masks (Triton functions cannot return None)
            row_ok, bmask, m8, m4 = None, None, None, None
        else:
            row_ok, _, bmask, m8, m4 = masks(rows, kbs, col, R, K)
        # The new v, from the gradient and the old states.
        g_lo, g_hi, b_lo, b_hi, sbits, row_old = v_loads(
            gp, vd, vs, row_root, rows, eoff, boff, soff, row_ok, bmask, m8, m4)
        v_lo, v_hi, root_lo, root_hi = v_from(
            g_lo, g_hi, b_lo, b_hi, sbits, row_old, col_lo, col_hi, dec, beta2, w2, m8, EVEN)
        m_lo, m_hi, _ = values(load(md + boff, m4), load(md + boff + 4, m4),
                                load(ms + soff, bmask), dec_m)
        m_lo = m_lo * root_lo  # stored normalized: m = m_hat * sqrt(v)
        m_hi = m_hi * root_hi
        m_lo = m_lo + (g_lo - m_lo) * w1
        m_hi = m_hi + (g_hi - m_hi) * w1
        root_lo = tl.sqrt_rn(v_lo)
        root_hi = tl.sqrt_rn(v_hi)
        # The stored form of v: its root times the reciprocal roots of its new factors.
        inv_row = load(inv + rows, row_ok)[:, None, None]
        st_lo = keep(root_lo * (inv_row * inv_lo), m8, EVEN)
        st_hi = keep(root_hi * (inv_row * inv_hi), m8, EVEN)
        if PASS == CALIBRATE:
            # The first step's amaxes: of stored v, and of m over the root of v as it is.
            vmax_run = jit.max_nan(vmax_run, jit.block_amax(st_lo, st_hi))
            n_lo = keep(safe_div(m_lo, root_lo), m8, EVEN)
            n_hi = keep(safe_div(m_hi, root_hi), m8, EVEN)
            mmax_run = jit.max_nan(mmax_run, jit.block_amax(n_lo, n_hi))
        else:
            p_lo = load(pp + eoff, m8)
            p_hi = load(pp + eoff + 8, m8)
            if DECAY:
                p_lo = p_lo * decay
                p_hi = p_hi * decay
            d_lo = root_lo * inv_bc2 + eps
            d_hi = root_hi * inv_bc2 + eps
            tl.store(pp + eoff, p_lo + tl.math.div_rn(m_lo * neg_step, d_lo), mask=m8)
            tl.store(pp + eoff + 8, p_hi + tl.math.div_rn(m_hi * neg_step, d_hi), mask=m8)
            vc_lo, vc_hi, vsbits, vmax = quantize(st_lo, st_hi, amax_v, eoff, kv1, kv2)
            # m over the root of the v the next step reads back, so m round-trips exactly.
            row_new = load(roots + rows, row_ok)[:, None, None]
            s_v = jit.e4m3_value(vsbits)[:, :, None]
            x_lo = (jit.e2m1_value(vc_lo) * s_v) * dec_v
            x_hi = (jit.e2m1_value(vc_hi) * s_v) * dec_v
            n_lo = keep(safe_div(m_lo, root_read(x_lo, s_v, dec_v, row_new * cn_lo)), m8,
                         EVEN)
            n_hi = keep(safe_div(m_hi, root_read(x_hi, s_v, dec_v, row_new * cn_hi)), m8,
                         EVEN)
            mc_lo, mc_hi, msbits, mmax = quantize(n_lo, n_hi, amax_m, eoff, km1, km2)
            vmax_run = jit.max_nan(vmax_run, vmax)
            mmax_run = jit.max_nan(mmax_run, mmax)
            # The new m and v replace the old ones in place: this tile's codes and block
            # scales are read by this program only, and past the barrier every thread of it
            # has read them.
            tl.debug_barrier()
            store_codes(vd, vs, boff, soff, m4, bmask, vc_lo, vc_hi, vsbits)
            store_codes(md, ms, boff, soff, m4, bmask, mc_lo, mc_hi, msbits)
        rows += BM
        eoff += BM * K
        boff += BM * (K // 2)
        soff += BM * (K // 16)
    if PASS == CALIBRATE:
        max_into(field(meta, VN, tl.float32), vmax_run * headroom)
        max_into(field(meta, MN, tl.float32), mmax_run * headroom)
    else:
        # The maxima the next step's amaxes come from (the factors launch rolls them).
        pending = pending_ptr + tl.load(meta + PENDING)
        max_into(pending, mmax_run)
        max_into(pending + 1, vmax_run)


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
    R = tl.load(meta + ROWS)
    K = tl.load(meta + COLS)
    line = pid - tl.load(meta + LINE0)
    scratch = tl.load(meta + SCRATCH)
    j = line * LINE + tl.arange(0, LINE)
    is_row = j < R
    is_col = (j >= R) & (j < R + K)
    ok = j < R + K
    if MODE == ROLL:
        root = tl.load(roots_ptr + scratch + j, mask=ok, other=0.0)
        tl.store(field(meta, ROW, tl.float32) + j, root, mask=is_row)
        tl.store(field(meta, COL, tl.float32) + (j - R), root, mask=is_col)
        if line == 0:
            headroom = tl.load(scal_ptr + S_HEADROOM)
            pending = pending_ptr + tl.load(meta + PENDING)
            m_next = field(meta, MN, tl.float32)
            v_next = field(meta, VN, tl.float32)
            tl.store(field(meta, MA, tl.float32), tl.load(m_next))
            tl.store(field(meta, VA, tl.float32), tl.load(v_next))
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
            tl.store(field(meta, MN, tl.float32), 0.0)
            tl.store(field(meta, VN, tl.float32), 0.0)
