"""Triton device code for NVFP4 quantize / fake-quantize / dequantize.

Each function mirrors a step of fp4stack/formats/nvfp4.py in float32. Where the reference leans
on a torch op whose GPU equivalent differs, this file spells the maths out:
- E4M3 rounding is integer arithmetic on the float32 bits (the Triton interpreter's fp8 cast is
  wrong for some values, and a cast has no NaN guarantee);
- divisions are `div_rn` (Triton's `/` is approximate on NVIDIA GPUs);
- max and min propagate NaN the way torch.amax and torch.clamp do;
- kernels are launched with fp fusion off, so no multiply-add is contracted into an FMA.
"""

from __future__ import annotations

import triton
import triton.language as tl

FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def e4m3_bits(v):
    """E4M3 RNE bits (int32, 0..0x7E; NaN -> 0x7F) of float32 v in [0, 448] or NaN."""
    # Subnormals (v < 2**-6) step by 2**-9: round v * 512 to an integer by the 2**23 trick. A
    # result of 8 is the bit pattern of 2**-6, the smallest normal, so the two ranges join up.
    t = v * 512.0
    sub = ((t + 8388608.0) - 8388608.0).to(tl.int32)
    # Normals: round the 23-bit mantissa to 3 bits (RNE), then rebias the exponent 127 -> 7.
    b = v.to(tl.int32, bitcast=True)
    b = b + 0x7FFFF + ((b >> 20) & 1)
    norm = (b >> 20) - ((127 - 7) << 3)
    bits = tl.where(v < 0.015625, sub, norm)
    return tl.where(v != v, 0x7F, bits)


@triton.jit
def e4m3_value(bits):
    """float32 value of E4M3 bits (int32)."""
    mag = bits & 0x7F
    sub = (mag & 7).to(tl.float32) * 0.001953125
    norm = ((mag + ((127 - 7) << 3)) << 20).to(tl.float32, bitcast=True)
    v = tl.where(mag < 8, sub, norm)
    v = tl.where(mag == 0x7F, float("nan"), v).to(tl.int32, bitcast=True)
    return (v | ((bits & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def sign_bit(y):
    """Bit 3 of an E2M1 code: set for y < 0 (not for -0.0 or NaN), as formats/e2m1.py."""
    return (y < 0).to(tl.int32) << 3


@triton.jit
def _e2m1_round_parts(y):
    # Round |y| to one mantissa bit by adding c = 2**(E + 22), E = max(exponent of |y|, 0): the
    # sum's ulp is the E2M1 step of that binade (0.5 below 2, then 1, then 2), and float32
    # addition rounds to nearest even. Clamping to 8 first keeps c finite and saturates.
    a = tl.minimum(tl.abs(y), 8.0)
    e = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, 127 << 23)
    c_bits = e + (22 << 23)
    s = a + c_bits.to(tl.float32, bitcast=True)
    return s, c_bits, e


@triton.jit
def e2m1_rne(y):
    """E2M1 codes (int32) of float32 y, RNE, saturating; NaN -> 0 (as in formats/e2m1.py)."""
    s, c_bits, e = _e2m1_round_parts(y)
    # s = c + k * step exactly, so k = bits(s) - bits(c); the code is k + 2E (capped at 7).
    code = tl.minimum((s.to(tl.int32, bitcast=True) - c_bits) + ((e >> 22) - 254), 7)
    code = tl.where(y != y, 0, code)
    return code | sign_bit(y)


@triton.jit
def e2m1_rne_value(y):
    """The float32 grid value of e2m1_rne(y) (NaN y gives 0, as its code does)."""
    s, c_bits, _ = _e2m1_round_parts(y)
    r = tl.minimum(s - c_bits.to(tl.float32, bitcast=True), 6.0)
    r = tl.where(y != y, 0.0, r)
    return (r.to(tl.int32, bitcast=True) | (sign_bit(y) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_magnitude(mag):
    """float32 value of a magnitude code 0..7."""
    big = tl.where(mag == 7, 6.0, (mag - 2).to(tl.float32))
    return tl.where(mag < 4, mag.to(tl.float32) * 0.5, big)


@triton.jit
def e2m1_value(code):
    # The sign goes in by bits: `-v` may compile to 0 - v, which loses the sign of -0.0.
    v = e2m1_magnitude(code & 7).to(tl.int32, bitcast=True)
    return (v | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def lowbias32(x):
    # x: uint32; products wrap mod 2**32.
    x = x ^ (x >> 16)
    x = x * tl.full((), 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def uniform(index, k1, k2):
    """float32 draws in [0, 1) for int64 linear indices, as formats/random.py `uniform`."""
    lo = (index & 0xFFFFFFFF).to(tl.uint32)
    hi = (index >> 32).to(tl.uint32)
    h = lowbias32(lo ^ k1)
    h = lowbias32(h ^ k2 ^ hi)
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def e2m1_stochastic(y, u):
    """E2M1 codes of y by stochastic rounding with draws u (see formats/e2m1.round_stochastic)."""
    a = tl.abs(y)
    lo = (a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
    lo += (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32)
    lo += (a >= 6.0).to(tl.int32)
    inv_gap = tl.where(lo < 4, 2.0, tl.where(lo < 6, 1.0, 0.5))
    frac = (a - e2m1_magnitude(lo)) * inv_gap
    up = (u < frac) & (lo < 7)
    mag = tl.where(up, lo + 1, lo)
    return mag | sign_bit(y)


@triton.jit
def butterfly(v, D: tl.constexpr):
    """One Walsh-Hadamard stage on rows of 16: (a, b) -> (a + b, a - b) for pairs D apart."""
    N: tl.constexpr = v.shape[0]
    w = tl.reshape(v, (N, 8 // D, 2, D))
    pair = tl.arange(0, 2)
    s = tl.sum(w, axis=2)  # a + b: a single add per pair
    d = tl.sum(w * tl.where(pair == 0, 1.0, -1.0)[None, None, :, None], axis=2)  # a + (-b)
    w = tl.where((pair == 0)[None, None, :, None], s[:, :, None, :], d[:, :, None, :])
    return tl.reshape(w, (N, 16))


@triton.jit
def rht16(v, SIGN_MASK: tl.constexpr):
    """x -> x · diag(s) · H16 / 4 on rows of 16 (v: [N, 16] float32), butterflies at 8, 4, 2, 1."""
    lane = tl.arange(0, 16)
    v = v * tl.where(((SIGN_MASK >> lane) & 1) != 0, -1.0, 1.0)[None, :]
    v = butterfly(butterfly(butterfly(butterfly(v, 8), 4), 2), 1)
    return v * 0.25


@triton.jit
def global_scales(amax, SCALE_MAX: tl.constexpr):
    """(S_enc, S_dec) from the global amax, as formats/nvfp4.global_encode_scale."""
    s_enc = min_nan(tl.math.div_rn(SCALE_MAX * 6.0, amax), FLT_MAX)
    s_enc = tl.where((amax == 0) | (s_enc == 0), 1.0, s_enc)
    return s_enc, tl.math.div_rn(1.0, s_enc)


@triton.jit
def block_scale_bits(bmax, s_enc, INV_TARGET: tl.constexpr):
    return e4m3_bits(min_nan(bmax * (s_enc * INV_TARGET), 448.0))


@triton.jit
def scaled(xb, scale_bits, s_dec):
    """Blocks xb [R, KB, 16] in units of their E4M3 scale [R, KB], ready for E2M1 rounding."""
    enc = min_nan(tl.math.div_rn(1.0, e4m3_value(scale_bits) * s_dec), FLT_MAX)
    # No clamp to [-6, 6]: the rounding functions saturate by themselves and map NaN to 0,
    # exactly as after the reference's clamp.
    return xb * enc[:, :, None]


@triton.jit
def encode(xb, scale_bits, s_dec, u, STOCHASTIC: tl.constexpr):
    """Codes of blocks xb [R, KB, 16] under E4M3 scale bits [R, KB]."""
    y = scaled(xb, scale_bits, s_dec)
    if STOCHASTIC:
        return e2m1_stochastic(y, u)
    else:
        return e2m1_rne(y)


@triton.jit
def block_sq_error(xb, codes, scale_bits, dec):
    # (x_hat - x)^2 summed over 16 elements pairwise (distance 1, 2, 4, 8), as the reference.
    R: tl.constexpr = xb.shape[0]
    KB: tl.constexpr = xb.shape[1]
    err = e2m1_value(codes) * e4m3_value(scale_bits)[:, :, None] * dec - xb
    sq = err * err
    sq = tl.sum(tl.reshape(sq, (R, KB, 8, 2)), axis=3)
    sq = tl.sum(tl.reshape(sq, (R, KB, 4, 2)), axis=3)
    sq = tl.sum(tl.reshape(sq, (R, KB, 2, 2)), axis=3)
    return tl.sum(sq, axis=2)


@triton.jit
def quad_step(t, N: tl.constexpr):
    """[T, 2N, KB, 2N] -> [T, N, KB, N]: each 2x2 group summed as (a00 + a11) + (a01 + a10)."""
    T: tl.constexpr = t.shape[0]
    KB: tl.constexpr = t.shape[2]
    w = tl.reshape(t, (T, N, 2, KB, N, 2))
    i = tl.arange(0, 2)
    diag = (i[:, None] == i[None, :])[None, None, :, None, None, :]
    d = tl.sum(tl.sum(tl.where(diag, w, 0.0), axis=5), axis=2)  # a00 + a11 (x + 0.0 is exact)
    a = tl.sum(tl.sum(tl.where(diag, 0.0, w), axis=5), axis=2)  # a01 + a10
    return d + a


@triton.jit
def tile_sq_error(xb, codes, scale_bits, dec):
    # 16x16 tiles: the tile's sum of (x_hat - x)^2 as a quadtree of 2x2 groups, as the reference
    # (every partial sum is transpose-invariant), repeated on the tile's 16 rows.
    R: tl.constexpr = xb.shape[0]
    KB: tl.constexpr = xb.shape[1]
    err = e2m1_value(codes) * e4m3_value(scale_bits)[:, :, None] * dec - xb
    t = tl.reshape(err * err, (R // 16, 16, KB, 16))
    t = quad_step(quad_step(quad_step(quad_step(t, 8), 4), 2), 1)
    t = tl.reshape(t, (R // 16, 1, KB))
    return tl.reshape(tl.broadcast_to(t, (R // 16, 16, KB)), (R, KB))


@triton.jit
def load_tile(x_ptr, b, rows, cols, M, K, sb, sm, sk, HADAMARD: tl.constexpr,
              SIGN_MASK: tl.constexpr):
    """Tile [BM, BK] of x (zero outside M x K) as float32, transformed when HADAMARD."""
    BM: tl.constexpr = rows.shape[0]
    BK: tl.constexpr = cols.shape[0]
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    ptrs = x_ptr + b.to(tl.int64) * sb + rows.to(tl.int64)[:, None] * sm
    ptrs += cols.to(tl.int64)[None, :] * sk
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if HADAMARD:
        x = tl.reshape(rht16(tl.reshape(x, (BM * BK // 16, 16)), SIGN_MASK), (BM, BK))
    return x, mask


@triton.jit
def amax_kernel(x_ptr, partial_ptr, M, K, sb, sm, sk,
                BM: tl.constexpr, BK: tl.constexpr, HADAMARD: tl.constexpr,
                SIGN_MASK: tl.constexpr):
    """Per-program max |x| (NaN-propagating) of a [B, M, K] tensor; reduced on the host side."""
    pid_m, pid_k, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    x, _ = load_tile(x_ptr, b, rows, cols, M, K, sb, sm, sk, HADAMARD, SIGN_MASK)
    m = tl.reduce(tl.reduce(tl.abs(x), 1, max_nan), 0, max_nan)
    pid = (b * tl.num_programs(1) + pid_k) * tl.num_programs(0) + pid_m
    tl.store(partial_ptr + pid, m)


@triton.jit
def quantize_kernel(
    x_ptr, amax_ptr, data_ptr, scale_ptr, out_ptr, nonfinite_ptr,
    M, K, KP, sb, sm, sk, k1, k2,
    BM: tl.constexpr, BK: tl.constexpr, IS_2D: tl.constexpr, HADAMARD: tl.constexpr,
    SIGN_MASK: tl.constexpr, STOCHASTIC: tl.constexpr, FOUR_OVER_SIX: tl.constexpr,
    SCALE_MAX: tl.constexpr, FAKE: tl.constexpr, CHECK_FINITE: tl.constexpr,
):
    """Quantize a [BM, BK] tile of x [B, M, K].

    FAKE=False writes packed codes to data [B, M, KP/2] and scale bits to scale [B, M, KP/16];
    FAKE=True writes the dequantized values to out [B, M, K] (x's dtype) instead.
    """
    pid_m, pid_k, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    KB: tl.constexpr = BK // 16
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    x, mask = load_tile(x_ptr, b, rows, cols, M, K, sb, sm, sk, HADAMARD, SIGN_MASK)
    if CHECK_FINITE:
        bad = tl.sum(tl.sum((~(tl.abs(x) < float("inf")) & mask).to(tl.int32), 1), 0)
        pid = (b * tl.num_programs(1) + pid_k) * tl.num_programs(0) + pid_m
        tl.store(nonfinite_ptr + pid, bad)

    amax = tl.load(amax_ptr)
    s_enc, s_dec = global_scales(amax, SCALE_MAX)
    xb = tl.reshape(x, (BM, KB, 16))
    bmax = tl.reduce(tl.abs(xb), 2, max_nan)
    if IS_2D:
        tile = tl.reduce(tl.reshape(bmax, (BM // 16, 16, KB)), 1, max_nan)
        bmax = tl.reshape(tl.broadcast_to(tile[:, None, :], (BM // 16, 16, KB)), (BM, KB))

    u = xb
    if STOCHASTIC:
        index = ((b * M + rows.to(tl.int64)) * KP)[:, None] + cols[None, :]
        u = tl.reshape(uniform(index, k1.to(tl.uint32), k2.to(tl.uint32)), (BM, KB, 16))

    sbits = block_scale_bits(bmax, s_enc, 1.0 / 6.0)
    if FAKE and not STOCHASTIC and not FOUR_OVER_SIX:
        # Hot path of fake quantization: the rounded value, without going through codes.
        vals = e2m1_rne_value(scaled(xb, sbits, s_dec))
    else:
        codes = encode(xb, sbits, s_dec, u, STOCHASTIC)
        if FOUR_OVER_SIX:
            dec = amax * (1.0 / (SCALE_MAX * 6.0))
            sbits4 = block_scale_bits(bmax, s_enc, 0.25)
            codes4 = encode(xb, sbits4, s_dec, u, STOCHASTIC)
            if IS_2D:
                err4 = tile_sq_error(xb, codes4, sbits4, dec)
                use4 = err4 < tile_sq_error(xb, codes, sbits, dec)
            else:
                err4 = block_sq_error(xb, codes4, sbits4, dec)
                use4 = err4 < block_sq_error(xb, codes, sbits, dec)
            sbits = tl.where(use4, sbits4, sbits)
            codes = tl.where(use4[:, :, None], codes4, codes)
        vals = e2m1_value(codes)

    if FAKE:
        dec = amax * (1.0 / (SCALE_MAX * 6.0))
        xh = vals * e4m3_value(sbits)[:, :, None] * dec
        ptrs = out_ptr + (b * M + rows.to(tl.int64))[:, None] * K + cols[None, :]
        tl.store(ptrs, tl.reshape(xh, (BM, BK)).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        lo, hi = tl.split(tl.reshape(codes, (BM, BK // 2, 2)))
        packed = (lo | (hi << 4)).to(tl.uint8)
        row_off = (b * M + rows.to(tl.int64))[:, None]
        dcols = pid_k * (BK // 2) + tl.arange(0, BK // 2)
        dmask = (rows < M)[:, None] & (dcols < KP // 2)[None, :]
        tl.store(data_ptr + row_off * (KP // 2) + dcols[None, :], packed, mask=dmask)
        scols = pid_k * KB + tl.arange(0, KB)
        smask = (rows < M)[:, None] & (scols < KP // 16)[None, :]
        tl.store(scale_ptr + row_off * (KP // 16) + scols[None, :], sbits.to(tl.uint8), mask=smask)


@triton.jit
def dequantize_kernel(data_ptr, scale_ptr, amax_ptr, out_ptr, R, K, KP,
                      BM: tl.constexpr, BK: tl.constexpr, SCALE_MAX: tl.constexpr):
    """out [R, K] = e2m1(code) * scale * (amax * (1 / (6 * SCALE_MAX)))."""
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
    dec = tl.load(amax_ptr) * (1.0 / (SCALE_MAX * 6.0))
    xh = e2m1_value(codes) * e4m3_value(sbits.to(tl.int32))[:, :, None] * dec
    cols = pid_k * BK + tl.arange(0, BK)
    mask = (rows < R)[:, None] & (cols < K)[None, :]
    out = tl.reshape(xh, (BM, BK)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row_off * K + cols[None, :], out, mask=mask)
