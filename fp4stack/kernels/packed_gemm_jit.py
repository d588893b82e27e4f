"""Triton device code for GEMMs on packed NVFP4 weights (dequantized in registers), grouped MoE.

Decode is bound by the weight bytes a kernel reads: a packed NVFP4 weight is 0.5625 bytes a
value (4-bit code + one E4M3 scale per 16) against BF16's 2, so these kernels read the packed
codes and scales and never write a dequantized copy. Each weight value is built exactly as
`nvfp4_kernels.dequantize_kernel` builds it, (e2m1(code) * scale) * D in float32, then rounded once
to the activation dtype with `cast_rne`, so the GEMM multiplies `fp4stack.dequantize(w, dtype)`
bit for bit; the products are summed in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .nvfp4_jit import (
    block_amax,
    block_scale_bits,
    cast_rne,
    e2m1_rne_value,
    e4m3_value,
    encode_factor,
    four_over_six_values,
    global_decode,
    global_scales,
    load_halves,
)

# The decode's two constant factors: (code bits * 2**-126) * (scale * 2**117) is the exact
# product e2m1(code) * scale * 2**-9, and multiplying it by D * 2**9 rounds once to the float32
# of (e2m1(code) * scale) * D, the reference's value. Both factors stay finite for every E4M3
# scale (<= 448) and every decode factor D (<= FLT_MAX / 2688), and no product loses a bit.
SCALE_LIFT = tl.constexpr(2.0**117)
DECODE_DROP = tl.constexpr(2.0**9)


@triton.jit
def nibble_value(words, J: tl.constexpr, lifted):
    """float32 e2m1(code) * scale * 2**-9 of the code in bits 4J .. 4J+3 of each int32 word,
    lifted its block's scale times SCALE_LIFT: the code's bits placed in a float32 (the E2M1
    magnitude at the top of the exponent and mantissa fields, read as value * 2**-126, as
    e2m1_value; the sign bit) and one multiply."""
    if J <= 5:  # noqa: SIM108 (J is a constexpr: one side is compiled)
        mag = (words << (22 - 4 * J)) & 0x01C00000
    else:
        mag = (words >> (4 * J - 22)) & 0x01C00000
    sign = (words << (28 - 4 * J)) & -0x80000000
    return (mag | sign).to(tl.float32, bitcast=True) * lifted


@triton.jit
def word_values(words, lifted):
    """float32 [R, 8 W]: the 8 codes of each int32 word of words [R, W] (the even element in
    the low nibble) as nibble_value, lifted [R, W] the scale of each word's block."""
    # tl.join stacks along a new last axis, so the first join is the slowest index of the 2x2x2
    # result: joining codes 4 apart, then 2, then 1 leaves them in order.
    v04 = tl.join(nibble_value(words, 0, lifted), nibble_value(words, 4, lifted))
    v26 = tl.join(nibble_value(words, 2, lifted), nibble_value(words, 6, lifted))
    v15 = tl.join(nibble_value(words, 1, lifted), nibble_value(words, 5, lifted))
    v37 = tl.join(nibble_value(words, 3, lifted), nibble_value(words, 7, lifted))
    v = tl.join(tl.join(v04, v26), tl.join(v15, v37))
    return tl.reshape(v, (words.shape[0], 8 * words.shape[1]))


@triton.jit
def packed_tile(wd_ptr, ws_ptr, dec9, n, n_ok, k0, K, KP, BK: tl.constexpr,
                PAD_K: tl.constexpr, EVEN_K: tl.constexpr):
    """float32 values [BN, BK] of a packed weight's rows n, columns k0 .. k0 + BK, exactly
    (e2m1(code) * scale) * D for dec9 = D * DECODE_DROP.

    wd_ptr addresses the codes as int32 words (KP/8 a row, 16-byte loads), ws_ptr the scale
    bytes (KP/16 a row). Rows past N and columns past KP load as code 0 with scale 0 (value 0;
    rows past N are never stored); EVEN_K: KP is a multiple of BK, no column mask. PAD_K (K not
    a multiple of 16): columns K .. KP are zeroed, since a NaN block scale would make NaN of the
    padding, which the reference cuts off before its GEMM."""
    BN: tl.constexpr = n.shape[0]
    KB: tl.constexpr = BK // 16
    row = n.to(tl.int64)[:, None]
    wcols = k0 // 8 + tl.arange(0, BK // 8)
    scols = k0 // 16 + tl.arange(0, KB)
    if EVEN_K:
        wmask = tl.broadcast_to(n_ok[:, None], (BN, BK // 8))
        smask = tl.broadcast_to(n_ok[:, None], (BN, KB))
    else:
        wmask = n_ok[:, None] & (wcols < KP // 8)[None, :]
        smask = n_ok[:, None] & (scols < KP // 16)[None, :]
    words = tl.load(wd_ptr + row * (KP // 8) + wcols[None, :], mask=wmask, other=0)
    sbits = tl.load(ws_ptr + row * (KP // 16) + scols[None, :], mask=smask, other=0)
    lifted = e4m3_value(sbits.to(tl.int32)) * SCALE_LIFT
    lifted = tl.reshape(tl.broadcast_to(lifted[:, :, None], (BN, KB, 2)), (BN, BK // 8))
    w = word_values(words, lifted) * dec9
    if PAD_K:
        w = tl.where((k0 + tl.arange(0, BK) < K)[None, :], w, 0.0)
    return w


@triton.jit
def round_to(v, ptr, NATIVE_CAST: tl.constexpr):
    """float32 v rounded to nearest even in ptr's element type. Compiled, Triton's cast is that
    (cvt.rn); the interpreter's bfloat16 cast is not, so there cast_rne's integer maths."""
    if NATIVE_CAST:
        return v.to(ptr.dtype.element_ty)
    else:
        return cast_rne(v, ptr)


@triton.jit
def finish(acc, bias_ptr, n, n_ok, out_ptr, HAS_BIAS: tl.constexpr, NATIVE_CAST: tl.constexpr):
    """The epilogue of QuantLinear's reference: y = acc rounded to the output dtype, then
    y + bias computed in float32 and rounded again (torch's `y + bias` in that dtype)."""
    y = round_to(acc, out_ptr, NATIVE_CAST)
    if HAS_BIAS:
        b = tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        y = round_to(y.to(tl.float32) + b[None, :], out_ptr, NATIVE_CAST)
    return y


@triton.jit
def gemm_kernel(
    a_ptr, w_ptr, ws_ptr, amax_ptr, bias_ptr, out_ptr, part_ptr, rows_ptr, tile_expert_ptr,
    M, N, K, KP, sam, swe, swn, A_DIV, sas, B1, B2,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
    W_PACKED: tl.constexpr, USE_DOT: tl.constexpr, GROUPED: tl.constexpr,
    HAS_BIAS: tl.constexpr, SCALE_MAX: tl.constexpr, MMA_TY: tl.constexpr,
    PRECISION: tl.constexpr, PAD_K: tl.constexpr, NATIVE_CAST: tl.constexpr,
    SWAP_AB: tl.constexpr = False, A_SEGMENTS: tl.constexpr = False, EVEN_K: tl.constexpr = False,
    lock_ptr=None, SERIAL_REDUCE: tl.constexpr = False,
):
    """out [M, N] = a [., K] @ W[e]ᵀ, fp32 sums; W packed NVFP4 (w_ptr its codes as int32
    words) or plain rows of a's dtype. EVEN_K: K is a multiple of BK (no column masks).

    Dense (GROUPED=False): program (m tile, n tile, k split); e = 0; with SPLIT_K > 1 each split
    writes its fp32 partial sums to part [SPLIT_K, M, N] and `splitk_reduce_kernel` adds them;
    or, SERIAL_REDUCE, the split that finishes last on its tile (counted in lock[tile], zeros
    before and after the launch) adds them itself, in split order as the reduce kernel does:
    one launch, the same bits.
    Grouped: program (tile, n tile); the tile's rows are rows_ptr[tile*BM ...] (pair ids, M for
    padding), all of expert tile_expert[tile] (-1: nothing to do); a row r reads a[r // A_DIV]
    and writes out[r].
    A_SEGMENTS (dense): output columns from B1 on read a + sas, from B2 on a + 2 * sas (an
    operand per sibling layer; the bounds are multiples of BN).
    """
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = 0
    if GROUPED:
        e = tl.load(tile_expert_ptr + pid_m)
        if e < 0:
            return
        r = tl.load(rows_ptr + pid_m * BM + tl.arange(0, BM))
        row_ok = r < M
        a_row = r // A_DIV
        out_row = r
    else:
        r = pid_m * BM + tl.arange(0, BM)
        row_ok = r < M
        a_row = r
        out_row = r
    n = pid_n * BN + tl.arange(0, BN)
    n_ok = n < N
    if A_SEGMENTS:
        n0 = pid_n * BN
        a_ptr += ((n0 >= B1).to(tl.int64) + (n0 >= B2).to(tl.int64)) * sas
    a_base = a_ptr + a_row.to(tl.int64)[:, None] * sam
    e64 = e.to(tl.int64) if GROUPED else 0
    if W_PACKED:
        wd = w_ptr + e64 * N * (KP // 8)
        ws = ws_ptr + e64 * N * (KP // 16)
        dec9 = global_decode(tl.load(amax_ptr + e64), SCALE_MAX) * DECODE_DROP
    else:
        wrow = w_ptr + e64 * swe + n.to(tl.int64)[:, None] * swn

    k_tiles = tl.cdiv(K, BK)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    pid_s = tl.program_id(2)
    kt0 = pid_s * per_split
    kt1 = tl.minimum(kt0 + per_split, k_tiles)
    acc = tl.zeros((BN, BM) if SWAP_AB else (BM, BN), dtype=tl.float32)
    for kt in range(kt0, kt1):
        k0 = kt * BK
        cols = k0 + tl.arange(0, BK)
        if EVEN_K:
            a = tl.load(a_base + cols[None, :], mask=row_ok[:, None], other=0.0)
        else:
            a = tl.load(a_base + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :],
                        other=0.0)
        if W_PACKED:
            w = round_to(packed_tile(wd, ws, dec9, n, n_ok, k0, K, KP, BK, PAD_K, EVEN_K), a_ptr,
                         NATIVE_CAST)
        else:
            if EVEN_K:
                w = tl.load(wrow + cols[None, :], mask=n_ok[:, None], other=0.0)
            else:
                w = tl.load(wrow + cols[None, :], mask=n_ok[:, None] & (cols < K)[None, :],
                            other=0.0)
        if SWAP_AB:
            # accᵀ = W aᵀ: the weight tile, decoded in registers, is the MMA's A operand, which
            # Hopper's wgmma reads from registers (M = BN >= 64), and the few rows of a are N.
            acc = tl.dot(w.to(MMA_TY), tl.trans(a.to(MMA_TY)), acc, input_precision=PRECISION)
        elif USE_DOT:
            # MMA_TY is a's dtype, or float32 under the interpreter (whose bf16 dot multiplies
            # the bit patterns); bf16 and fp16 products are exact in float32 either way.
            acc = tl.dot(a.to(MMA_TY), tl.trans(w.to(MMA_TY)), acc, input_precision=PRECISION)
        else:  # few rows: a broadcast product, no layout change of w for the tensor cores
            prod = a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            acc += tl.sum(prod, axis=2)

    if SWAP_AB:
        acc = tl.trans(acc)
    mask = row_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        y = finish(acc, bias_ptr, n, n_ok, out_ptr, HAS_BIAS, NATIVE_CAST)
        tl.store(out_ptr + out_row.to(tl.int64)[:, None] * N + n[None, :], y, mask=mask)
    else:
        off = out_row.to(tl.int64)[:, None] * N + n[None, :]
        tl.store(part_ptr + pid_s.to(tl.int64) * M * N + off, acc, mask=mask)
        if SERIAL_REDUCE:
            # Every thread's partial sums are written before one thread counts this split in,
            # with release-acquire order at GPU scope; the last split's loads bypass L1.
            tl.debug_barrier()
            lock = lock_ptr + pid_m * tl.num_programs(1) + pid_n
            if tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
                total = tl.load(part_ptr + off, mask=mask, other=0.0, cache_modifier=".cg")
                for s in tl.static_range(1, SPLIT_K):
                    total += tl.load(part_ptr + tl.full((), s, tl.int64) * M * N + off,
                                     mask=mask, other=0.0, cache_modifier=".cg")
                y = finish(total, bias_ptr, n, n_ok, out_ptr, HAS_BIAS, NATIVE_CAST)
                tl.store(out_ptr + off, y, mask=mask)
                tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def splitk_reduce_kernel(part_ptr, bias_ptr, out_ptr, M, N, SPLIT_K: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, HAS_BIAS: tl.constexpr,
                         NATIVE_CAST: tl.constexpr):
    """out = finish(part[0] + part[1] + ... in split order): deterministic, no atomics."""
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = n < N
    mask = (r < M)[:, None] & n_ok[None, :]
    off = r.to(tl.int64)[:, None] * N + n[None, :]
    acc = tl.load(part_ptr + off, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + tl.full((), s, tl.int64) * M * N + off, mask=mask, other=0.0)
    tl.store(out_ptr + off, finish(acc, bias_ptr, n, n_ok, out_ptr, HAS_BIAS, NATIVE_CAST),
             mask=mask)


@triton.jit
def column_sq_norms_kernel(wd_ptr, ws_ptr, amax_ptr, like_ptr, out_ptr, N, K, KP,
                           BN: tl.constexpr, BK: tl.constexpr, SCALE_MAX: tl.constexpr,
                           PAD_K: tl.constexpr, NATIVE_CAST: tl.constexpr):
    """out[e, c] = sum over rows of Q(W_e)[:, c]^2 (Q(W_e) rounded to like's dtype, squared
    and summed in float32) for the weights W_e [N, K] of a stack (program_id(1) = e), for
    residual compensation's channel energy; reads the packed weights once."""
    k0 = tl.program_id(0) * BK
    e = tl.program_id(1).to(tl.int64)
    wd_ptr += e * N * (KP // 8)
    ws_ptr += e * N * (KP // 16)
    out_ptr += e * K
    dec9 = global_decode(tl.load(amax_ptr + e), SCALE_MAX) * DECODE_DROP
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for n0 in range(0, N, BN):
        n = n0 + tl.arange(0, BN)
        w = packed_tile(wd_ptr, ws_ptr, dec9, n, n < N, k0, K, KP, BK, PAD_K, False)
        w = round_to(w, like_ptr, NATIVE_CAST).to(tl.float32)
        acc += w * w
    cols = k0 + tl.arange(0, BK)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < K)


@triton.jit
def fake_quantize_halves(lo, hi, amax, FOUR_OVER_SIX: tl.constexpr, SCALE_MAX: tl.constexpr):
    """The float32 values of fake_quantize (RNE, 1x16 blocks) of the half-blocks lo, hi
    [BM, KB, 8], row i with the global amax amax[i]: nvfp4_kernels.quantize_kernel's maths for
    FAKE, before the cast to the output dtype."""
    s_enc, s_dec = global_scales(amax, SCALE_MAX)
    bmax = block_amax(lo, hi)
    dec = global_decode(amax, SCALE_MAX)[:, None, None]
    if FOUR_OVER_SIX:
        sbits, val_lo, val_hi = four_over_six_values(lo, hi, bmax, s_enc[:, None],
                                                     s_dec[:, None], dec, False)
    else:
        sbits = block_scale_bits(bmax, s_enc[:, None], 1.0 / 6.0)
        enc = encode_factor(sbits, s_dec[:, None])[:, :, None]
        val_lo = e2m1_rne_value(lo * enc)
        val_hi = e2m1_rne_value(hi * enc)
    s = e4m3_value(sbits)[:, :, None]
    return val_lo * s * dec, val_hi * s * dec


@triton.jit
def rows_fake_quantize_kernel(x_ptr, amax_ptr, group_ptr, out_ptr, R, K, sxm, DIV,
                              BM: tl.constexpr, KB: tl.constexpr, FOUR_OVER_SIX: tl.constexpr,
                              SCALE_MAX: tl.constexpr):
    """out [R, K] = fake_quantize(x[r // DIV]) with the global amax amax[group[r]]: the
    per-expert activation quantization of the grouped MoE. Row for row the maths of
    nvfp4_kernels.quantize_kernel (FAKE, RNE, 1x16 blocks), only the amax differs per row."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    kbs = pid_k * KB + tl.arange(0, KB)
    row_ok = rows < R
    # Rows past R read source rows past R // DIV, which load_halves masks; program_id(2) is
    # the batch index 0 (the grid has one).
    lo, hi, mask_lo, mask_hi = load_halves(x_ptr, tl.program_id(2), rows // DIV, kbs,
                                           tl.cdiv(R, DIV), K, 0, sxm, 1, False, 0)
    g = tl.load(group_ptr + rows, mask=row_ok, other=0)
    amax = tl.load(amax_ptr + g, mask=row_ok, other=1.0)  # rows past R are not stored
    q_lo, q_hi = fake_quantize_halves(lo, hi, amax, FOUR_OVER_SIX, SCALE_MAX)
    col_lo = kbs[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]
    base = out_ptr + rows.to(tl.int64)[:, None, None] * K
    row3 = row_ok[:, None, None]
    tl.store(base + col_lo, cast_rne(q_lo, out_ptr), mask=mask_lo & row3)
    tl.store(base + col_lo + 8, cast_rne(q_hi, out_ptr), mask=mask_hi & row3)
