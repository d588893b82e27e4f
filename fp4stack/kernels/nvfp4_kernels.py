"""The Triton kernels of NVFP4 quantize / fake-quantize / dequantize and the global amax,
built from the device functions of nvfp4_jit (each a step of fp4stack/formats/nvfp4.py in
float32); launched by kernels/nvfp4.py."""

from __future__ import annotations

import triton
import triton.language as tl

from .nvfp4_jit import (
    abs_max,
    block_amax,
    block_scale_bits,
    cast_rne,
    e2m1_rne_value,
    e2m1_value,
    e4m3_value,
    encode_factor,
    four_over_six_values,
    global_decode,
    global_scales,
    load_halves,
    max_nan,
    pack_pairs,
    round_half,
    sq_error,
    uniform,
)


@triton.jit
def rows_abs_max(x_ptr, b, rows, kb0, M, K, sb, sm, sk, KB: tl.constexpr,
                 HADAMARD: tl.constexpr, SIGN_MASK: tl.constexpr):
    """max |x| (NaN-propagating) of each row `rows` of x[b] over the KB 16-element blocks from
    block kb0 (after the Hadamard transform when HADAMARD); 0 outside M x K."""
    if HADAMARD:
        kbs = kb0 + tl.arange(0, KB)
        lo, hi, _, _ = load_halves(x_ptr, b, rows, kbs, M, K, sb, sm, sk, HADAMARD, SIGN_MASK)
        return abs_max(block_amax(lo, hi), 1)
    else:
        # A plain 2D tile: nothing here needs block structure, and wide loads read fastest.
        cols = kb0 * 16 + tl.arange(0, KB * 16)
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        ptrs = x_ptr + b.to(tl.int64) * sb + rows.to(tl.int64)[:, None] * sm
        x = tl.load(ptrs + cols.to(tl.int64)[None, :] * sk, mask=mask, other=0.0)
        return abs_max(x.to(tl.float32), 1)


@triton.jit
def amax_kernel(x_ptr, partial_ptr, M, K, sb, sm, sk,
                BM: tl.constexpr, KB: tl.constexpr, HADAMARD: tl.constexpr,
                SIGN_MASK: tl.constexpr, ROWS: tl.constexpr):
    """Per-program max |x| (NaN-propagating) of a [B, M, K] tensor, reduced on the host side:
    one value a program, or with ROWS one a row, at partial[pid_k, b * M + row]."""
    pid_m, pid_k, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    m = rows_abs_max(x_ptr, b, rows, pid_k * KB, M, K, sb, sm, sk, KB, HADAMARD, SIGN_MASK)
    if ROWS:
        row_off = (pid_k * tl.num_programs(2) + b).to(tl.int64) * M + rows
        tl.store(partial_ptr + row_off, m, mask=rows < M)
    else:
        pid = (b * tl.num_programs(1) + pid_k) * tl.num_programs(0) + pid_m
        tl.store(partial_ptr + pid, abs_max(m, 0))


@triton.jit
def amax_pair_kernel(x_ptr, partial_ptr, partial_t_ptr, M, K, sm, sk,
                     BM: tl.constexpr, KB: tl.constexpr, HADAMARD: tl.constexpr,
                     HADAMARD_T: tl.constexpr, SIGN_MASK: tl.constexpr):
    """Per-program max |x| (NaN-propagating) of BM rows x KB blocks of x [M, K], along its
    rows (transformed when HADAMARD) and along its columns (transformed when HADAMARD_T), from
    one read: the two global amaxes of `fake_quantize_pair`, reduced on the host side."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    pid = pid_k * tl.num_programs(0) + pid_m
    b = tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    kbs = pid_k * KB + tl.arange(0, KB)
    lo, hi, _, _ = load_halves(x_ptr, b, rows, kbs, M, K, 0, sm, sk, HADAMARD, SIGN_MASK)
    tl.store(partial_ptr + pid, abs_max(abs_max(block_amax(lo, hi), 1), 0))
    cols = pid_k * (KB * 16) + tl.arange(0, KB * 16)
    mbs = pid_m * (BM // 16) + tl.arange(0, BM // 16)
    lo, hi, _, _ = load_halves(x_ptr, b, cols, mbs, K, M, 0, sk, sm, HADAMARD_T, SIGN_MASK)
    tl.store(partial_t_ptr + pid, abs_max(abs_max(block_amax(lo, hi), 1), 0))


@triton.jit
def tensor_abs_max(x_ptr, B, M, K, sb, sm, sk, BM: tl.constexpr, KB: tl.constexpr,
                   HADAMARD: tl.constexpr, SIGN_MASK: tl.constexpr):
    """max |x| (NaN-propagating, a 0-d float32) of the whole [B, M, K] tensor, by one program."""
    acc = tl.full((), 0.0, tl.float32)
    for b_ in range(B):
        b = b_ * tl.full((), 1, tl.int64)  # a tensor (under the interpreter range gives ints)
        for r0 in range(0, M, BM):
            acc = max_nan(acc, abs_max(row_abs_max(x_ptr, b, r0 + tl.arange(0, BM), M, K, sb,
                                                   sm, sk, KB, HADAMARD, SIGN_MASK), 0))
    return acc


@triton.jit
def row_abs_max(x_ptr, b, rows, M, K, sb, sm, sk, KB: tl.constexpr, HADAMARD: tl.constexpr,
                SIGN_MASK: tl.constexpr):
    """max |x| (NaN-propagating) of each whole row `rows` of x[b] [M, K]; 0 past M."""
    acc = tl.zeros(rows.shape, dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, 16), KB):
        acc = max_nan(acc, rows_abs_max(x_ptr, b, rows, k0, M, K, sb, sm, sk, KB, HADAMARD,
                                        SIGN_MASK))
    return acc


@triton.jit
def amax_small_kernel(x_ptr, out_ptr, B, M, K, sb, sm, sk,
                      BM: tl.constexpr, KB: tl.constexpr, HADAMARD: tl.constexpr,
                      SIGN_MASK: tl.constexpr, ROWS: tl.constexpr):
    """max |x| (NaN-propagating) of a small [B, M, K] tensor by one program, in out (0-d), or
    with ROWS each row's at out[b * M + row]: amax_kernel's values without the host-side
    reduction, so a small operand (a decoding step's) costs one launch, not two."""
    if ROWS:
        for b_ in range(B):
            b = b_ * tl.full((), 1, tl.int64)
            for r0 in range(0, M, BM):
                rows = r0 + tl.arange(0, BM)
                m = row_abs_max(x_ptr, b, rows, M, K, sb, sm, sk, KB, HADAMARD, SIGN_MASK)
                tl.store(out_ptr + b * M + rows, m, mask=rows < M)
    else:
        tl.store(out_ptr, tensor_abs_max(x_ptr, B, M, K, sb, sm, sk, BM, KB, HADAMARD,
                                         SIGN_MASK))


@triton.jit
def quantize_kernel(
    x_ptr, amax_ptr, data_ptr, scale_ptr, out_ptr, nonfinite_ptr,
    M, K, KP, sb, sm, sk, k1, k2,
    BM: tl.constexpr, KB: tl.constexpr, IS_2D: tl.constexpr, HADAMARD: tl.constexpr,
    SIGN_MASK: tl.constexpr, STOCHASTIC: tl.constexpr, FOUR_OVER_SIX: tl.constexpr,
    SCALE_MAX: tl.constexpr, FAKE: tl.constexpr, CHECK_FINITE: tl.constexpr,
    ROW_AMAX: tl.constexpr, AMAX_HERE: tl.constexpr = False, B=1,
    MATRIX_AMAX: tl.constexpr = False, UNITS: tl.constexpr = False,
):
    """Quantize BM rows x KB blocks of x [B, M, K].

    FAKE=False writes packed codes to data [B, M, KP/2] and scale bits to scale [B, M, KP/16];
    FAKE=True writes the dequantized values to out [B, M, K] (x's dtype) instead. ROW_AMAX:
    amax holds one value a row [B * M] (a row-scaled spec) instead of one.
    AMAX_HERE: the program computes the amax itself (the whole tensor's, which every program
    reads; or its rows' with ROW_AMAX) and writes it to amax_ptr: a small operand's amax and
    quantization in one launch instead of two. MATRIX_AMAX: one amax for each x[b] (a stack
    of matrices, each quantized as alone). UNITS (with FAKE): the values divided by the global
    decode scale, i.e. E2M1 value times E4M3 block scale.
    """
    pid_m, pid_k, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    kbs = pid_k * KB + tl.arange(0, KB)
    lo, hi, mask_lo, mask_hi = load_halves(x_ptr, b, rows, kbs, M, K, sb, sm, sk,
                                           HADAMARD, SIGN_MASK)
    if CHECK_FINITE:
        bad = (~(tl.abs(lo) < float("inf")) & mask_lo).to(tl.int32)
        bad += (~(tl.abs(hi) < float("inf")) & mask_hi).to(tl.int32)
        pid = (b * tl.num_programs(1) + pid_k) * tl.num_programs(0) + pid_m
        tl.store(nonfinite_ptr + pid, tl.sum(tl.sum(tl.sum(bad, 2), 1), 0))

    if ROW_AMAX:  # [BM, 1] against the blocks' [BM, KB]
        if AMAX_HERE:
            amax = row_abs_max(x_ptr, b.to(tl.int64), rows, M, K, sb, sm, sk, KB, HADAMARD,
                               SIGN_MASK)
            if pid_k == 0:
                tl.store(amax_ptr + b * M + rows, amax, mask=rows < M)
            amax = tl.where(rows < M, amax, 0.0)[:, None]
        else:
            amax = tl.load(amax_ptr + b * M + rows, mask=rows < M, other=0.0)[:, None]
    elif MATRIX_AMAX:
        amax = tl.load(amax_ptr + b)
    else:
        if AMAX_HERE:
            amax = tensor_abs_max(x_ptr, B, M, K, sb, sm, sk, BM, KB, HADAMARD, SIGN_MASK)
            if (pid_m == 0) & (pid_k == 0) & (b == 0):
                tl.store(amax_ptr, amax)
        else:
            amax = tl.load(amax_ptr)
    store_quantized(lo, hi, amax, b, rows, kbs, M, K, KP, k1, k2, data_ptr, scale_ptr, out_ptr,
                    IS_2D, STOCHASTIC, FOUR_OVER_SIX, SCALE_MAX, FAKE, ROW_AMAX, UNITS)


@triton.jit
def quantize_pair_kernel(
    x_ptr, amax_ptr, amax_t_ptr, out_ptr, out_t_ptr, M, K, KP, CT, KPT, sm, sk, k1, k2, k1t, k2t,
    BM: tl.constexpr, KB: tl.constexpr, SIGN_MASK: tl.constexpr,
    HADAMARD: tl.constexpr, STOCHASTIC: tl.constexpr, FOUR_OVER_SIX: tl.constexpr,
    SCALE_MAX: tl.constexpr, HADAMARD_T: tl.constexpr, STOCHASTIC_T: tl.constexpr,
    FOUR_OVER_SIX_T: tl.constexpr, SCALE_MAX_T: tl.constexpr,
):
    """Fake-quantize x [M, K] along its rows into out [M, K], and xᵀ (zero-padded to CT >= M
    columns) along its rows into out_t [K, CT], each with its own spec: one program takes BM
    rows x KB blocks of x for both, so the tile comes from memory once and its second read,
    along the columns, from the cache. BM is a multiple of 16 (whole blocks of xᵀ)."""
    pid_m, pid_k, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    kbs = pid_k * KB + tl.arange(0, KB)
    lo, hi, _, _ = load_halves(x_ptr, b, rows, kbs, M, K, 0, sm, sk, HADAMARD, SIGN_MASK)
    store_quantized(lo, hi, tl.load(amax_ptr), b, rows, kbs, M, K, KP, k1, k2, out_ptr, out_ptr,
                    out_ptr, False, STOCHASTIC, FOUR_OVER_SIX, SCALE_MAX, True, False)
    cols = pid_k * (KB * 16) + tl.arange(0, KB * 16)
    mbs = pid_m * (BM // 16) + tl.arange(0, BM // 16)
    lo, hi, _, _ = load_halves(x_ptr, b, cols, mbs, K, M, 0, sk, sm, HADAMARD_T, SIGN_MASK)
    store_quantized(lo, hi, tl.load(amax_t_ptr), b, cols, mbs, K, CT, KPT, k1t, k2t, out_t_ptr,
                    out_t_ptr, out_t_ptr, False, STOCHASTIC_T, FOUR_OVER_SIX_T, SCALE_MAX_T,
                    True, False)


@triton.jit
def store_quantized(lo, hi, amax, b, rows, kbs, M, K, KP, k1, k2, data_ptr, scale_ptr, out_ptr,
                    IS_2D: tl.constexpr, STOCHASTIC: tl.constexpr,
                    FOUR_OVER_SIX: tl.constexpr, SCALE_MAX: tl.constexpr, FAKE: tl.constexpr,
                    ROW_AMAX: tl.constexpr, UNITS: tl.constexpr = False):
    """Quantize the half-blocks lo, hi [BM, KB, 8] of rows `rows`, blocks `kbs` of x[b] [M, K]
    (K padded to KP) with the global amax (0-d, or [BM, 1] with ROW_AMAX) and store them: the
    dequantized values in out [B, M, K] (FAKE; UNITS: not times the decode scale), or codes
    in data and scale bits in scale."""
    BM: tl.constexpr = lo.shape[0]
    KB: tl.constexpr = lo.shape[1]
    dec = global_decode(amax, SCALE_MAX)
    if ROW_AMAX:
        dec = dec[:, :, None]  # against [BM, KB, 8]
    s_enc, s_dec = global_scales(amax, SCALE_MAX)
    bmax = block_amax(lo, hi)
    if IS_2D:
        tile = abs_max(tl.reshape(bmax, (BM // 16, 16, KB)), 1)
        bmax = tl.reshape(tl.broadcast_to(tile[:, None, :], (BM // 16, 16, KB)), (BM, KB))

    u_lo = lo
    u_hi = hi
    if STOCHASTIC:
        index = ((b * M + rows.to(tl.int64)) * KP)[:, None, None]
        index += kbs[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]
        u_lo = uniform(index, k1.to(tl.uint32), k2.to(tl.uint32))
        u_hi = uniform(index + 8, k1.to(tl.uint32), k2.to(tl.uint32))

    if FAKE and not STOCHASTIC:
        # Hot paths of fake quantization: the rounded values, without going through codes.
        if FOUR_OVER_SIX:
            sbits, val_lo, val_hi = four_over_six_values(lo, hi, bmax, s_enc, s_dec, dec, IS_2D)
        else:
            sbits = block_scale_bits(bmax, s_enc, 1.0 / 6.0)
            enc = encode_factor(sbits, s_dec)[:, :, None]
            val_lo = e2m1_rne_value(lo * enc)
            val_hi = e2m1_rne_value(hi * enc)
    else:
        sbits = block_scale_bits(bmax, s_enc, 1.0 / 6.0)
        enc = encode_factor(sbits, s_dec)[:, :, None]
        code_lo = round_half(lo * enc, u_lo, STOCHASTIC)
        code_hi = round_half(hi * enc, u_hi, STOCHASTIC)
        if FOUR_OVER_SIX:
            sbits4 = block_scale_bits(bmax, s_enc, 0.25)
            enc4 = encode_factor(sbits4, s_dec)[:, :, None]
            code4_lo = round_half(lo * enc4, u_lo, STOCHASTIC)
            code4_hi = round_half(hi * enc4, u_hi, STOCHASTIC)
            err4 = sq_error(lo, hi, e2m1_value(code4_lo), e2m1_value(code4_hi), sbits4, dec,
                            IS_2D)
            use4 = err4 < sq_error(lo, hi, e2m1_value(code_lo), e2m1_value(code_hi), sbits,
                                   dec, IS_2D)
            sbits = tl.where(use4, sbits4, sbits)
            code_lo = tl.where(use4[:, :, None], code4_lo, code_lo)
            code_hi = tl.where(use4[:, :, None], code4_hi, code_hi)
        val_lo = e2m1_value(code_lo)
        val_hi = e2m1_value(code_hi)

    row_off = (b * M + rows.to(tl.int64))[:, None, None]
    if FAKE:
        s = e4m3_value(sbits)[:, :, None]
        col_lo = kbs[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]
        mask_lo = (rows < M)[:, None, None] & (col_lo < K)
        mask_hi = (rows < M)[:, None, None] & (col_lo + 8 < K)
        if UNITS:
            out_lo = val_lo * s
            out_hi = val_hi * s
        else:
            out_lo = val_lo * s * dec
            out_hi = val_hi * s * dec
        tl.store(out_ptr + row_off * K + col_lo, cast_rne(out_lo, out_ptr), mask=mask_lo)
        tl.store(out_ptr + row_off * K + col_lo + 8, cast_rne(out_hi, out_ptr), mask=mask_hi)
    else:
        row_ok = (rows < M)[:, None, None]
        dcol = kbs[None, :, None] * 8 + tl.arange(0, 4)[None, None, :]
        dmask = row_ok & (kbs < KP // 16)[None, :, None]
        ptr = data_ptr + row_off * (KP // 2) + dcol
        nan_block = (sbits == 0x7F)[:, :, None]  # the reference's codes there are all 0
        tl.store(ptr, tl.where(nan_block, 0, pack_pairs(code_lo)), mask=dmask)
        tl.store(ptr + 4, tl.where(nan_block, 0, pack_pairs(code_hi)), mask=dmask)
        smask = (rows < M)[:, None] & (kbs < KP // 16)[None, :]
        sptr = scale_ptr + (b * M + rows.to(tl.int64))[:, None] * (KP // 16) + kbs[None, :]
        tl.store(sptr, sbits.to(tl.uint8), mask=smask)


@triton.jit
def dequantize_kernel(data_ptr, scale_ptr, amax_ptr, out_ptr, R, K, KP,
                      BM: tl.constexpr, BK: tl.constexpr, SCALE_MAX: tl.constexpr,
                      ROW_AMAX: tl.constexpr):
    """out [R, K] = e2m1(code) * scale * D (D: global_decode of the amax, one a row with
    ROW_AMAX)."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    KB: tl.constexpr = BK // 16
    rows = pid_m * BM + tl.arange(0, BM)
    row_off = rows.to(tl.int64)[:, None]
    dcols = pid_k * (BK // 2) + tl.arange(0, BK // 2)
    dmask = (rows < R)[:, None] & (dcols < KP // 2)[None, :]
    packed = tl.load(data_ptr + row_off * (KP // 2) + dcols[None, :], mask=dmask, other=0)
    packed = packed.to(tl.int32)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BM, KB, 16))
    scols = pid_k * KB + tl.arange(0, KB)
    smask = (rows < R)[:, None] & (scols < KP // 16)[None, :]
    sbits = tl.load(scale_ptr + row_off * (KP // 16) + scols[None, :], mask=smask, other=0)
    if ROW_AMAX:
        amax = tl.load(amax_ptr + rows, mask=rows < R, other=0.0)
        dec = global_decode(amax, SCALE_MAX)[:, None, None]
    else:
        dec = global_decode(tl.load(amax_ptr), SCALE_MAX)
    xh = e2m1_value(codes) * e4m3_value(sbits.to(tl.int32))[:, :, None] * dec
    cols = pid_k * BK + tl.arange(0, BK)
    mask = (rows < R)[:, None] & (cols < K)[None, :]
    out = cast_rne(tl.reshape(xh, (BM, BK)), out_ptr)
    tl.store(out_ptr + row_off * K + cols[None, :], out, mask=mask)
