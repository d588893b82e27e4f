"""Triton device code for NVFP4 quantize / fake-quantize / dequantize.

Each function mirrors a step of fp4stack/formats/nvfp4.py in float32. Where the reference leans
on a torch op whose GPU equivalent differs, this file spells the maths out:
- E4M3 rounding is integer arithmetic on the float32 bits (the Triton interpreter's fp8 cast is
  wrong for some values, and a cast has no NaN guarantee), and so is the rounding to bfloat16
  of the outputs (`cast_rne`);
- divisions are `div_rn` (Triton's `/` is approximate on NVIDIA GPUs);
- max and min propagate NaN the way torch.amax and torch.clamp do;
- kernels are launched with fp fusion off, so no multiply-add is contracted into an FMA.
"""

from __future__ import annotations

import triton
import triton.language as tl

FLT_MAX = tl.constexpr(3.4028234663852886e38)
CAPPED_DECODE = tl.constexpr(2.0**-128)  # fl32(1 / FLT_MAX)


@triton.jit
def max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def abs_max(x, axis):
    """max |x| of float32 x along `axis`, NaN where any element is NaN (torch.amax of |x|).

    With the sign bit cleared, float32 bit patterns read as int32 order like the values, and a
    NaN's lie above +inf's, so this is one integer max: a standard reduction, which the Triton
    interpreter runs vectorised (a custom combine function runs there element by element)."""
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.max(bits, axis).to(tl.float32, bitcast=True)


@triton.jit
def cast_rne(v, ptr):
    """float32 v in ptr's element type, rounded to nearest even as torch's cast rounds. To
    bfloat16 by integer arithmetic on the bits: the Triton interpreter's bfloat16 cast rounds
    half up without carrying, so the CPU tests could not check the GPU's cast otherwise."""
    ty: tl.constexpr = ptr.dtype.element_ty
    if ty == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(v != v, 0x7FC0, rounded)  # NaN stays NaN (the carry could clear it)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(ty)


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
def _e2m1_round_parts(y, RNE: tl.constexpr = True):
    # |y| clamped to 6 lies in binade E = 0 (below 2), 1 ([2, 4)) or 2 ([4, 6]), where the E2M1
    # step is 2**(E - 1). Scaling by m = 2**(1 - E) is exact; with RNE, adding 2**23 rounds to an
    # integer n by float32 round-to-nearest-even: the grid value is n * 2**(E - 1), the code
    # n + 2E. Without, t = |y| * m itself (in steps of the binade).
    a = tl.minimum(tl.abs(y), 6.0)
    e = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, 127 << 23)  # 2**E, as bits
    m = ((255 << 23) - e).to(tl.float32, bitcast=True)  # 2**(1 - E)
    t = a * m
    if RNE:
        t = t + 8388608.0  # a * m is exact, so this is one rounding
    return t, e


@triton.jit
def e2m1_rne(y):
    """E2M1 codes (int32) of float32 y, RNE, saturating, as formats/e2m1.round_rne, except that
    a NaN y gives an arbitrary code: a NaN y only occurs in a block whose scale is NaN, and the
    kernel zeroes such blocks as a whole when it stores them (one test per 8 codes, not per
    element)."""
    y = y + 0.0  # turns -0.0 into +0.0 (code 0: -0.0 < 0 is false) and changes nothing else
    t, e = _e2m1_round_parts(y)
    code = t.to(tl.int32, bitcast=True) + ((e >> 22) - (0x4B000000 + 254))  # n + 2E
    return code | ((y.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def e2m1_rne_value(y):
    """The float32 grid value of e2m1_rne(y); arbitrary for NaN y (its block scale is NaN, so
    the dequantized product is NaN all the same)."""
    y = y + 0.0  # -0.0 -> +0.0, as in e2m1_rne
    t, e = _e2m1_round_parts(y)
    r = (t - 8388608.0) * (e - (1 << 23)).to(tl.float32, bitcast=True)  # n * 2**(E - 1)
    sign = y.to(tl.int32, bitcast=True) & (-2147483648)
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_value(code):
    """float32 value of an E2M1 code (int32), built from its bits: the magnitude bits (e, m)
    placed at the top of a float32's exponent and mantissa fields make the float32 whose value
    is the E2M1 value times 2**-126 (e = 0 lands in the subnormals, as 0 and 0.5 need), and the
    product with 2**126 is exact. The sign goes in by bits too (`-v` may compile to 0 - v,
    which loses the sign of -0.0). Kernels run without flush-to-zero, so subnormals survive."""
    bits = ((code & 7) << 22) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2**126


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
    """E2M1 codes of y by stochastic rounding with draws u (see formats/e2m1.round_stochastic):
    the grid point below |y| (clamped to 6), one up when u < the fraction of the step |y| has
    covered. In the binade's units (|y| * 2**(1 - E), exact) the point below is the floor and
    the fraction what is left, both exact, so they equal the reference's (|y| - lo) / gap. A
    NaN y gives an arbitrary code, as in e2m1_rne."""
    t, e = _e2m1_round_parts(y, False)
    n = tl.floor(t)
    mag = n.to(tl.int32) + ((e >> 22) - 254)  # n + 2E
    mag = tl.where(u < t - n, mag + 1, mag)  # at 6 (code 7) the fraction is 0: never up
    return mag | sign_bit(y)


# Blocks are handled as two half-blocks `lo` (elements 0-7) and `hi` (8-15), each [BM, KB, 8]:
# a thread then holds whole blocks (one 16-byte load per half for bf16), so per-block work is done
# once and no reduction crosses threads; and the specification's fixed orders (the first RHT
# butterfly, the last pairwise add of the 4/6 error) pair lo with hi element-wise.


@triton.jit
def butterfly8(v, D: tl.constexpr):
    """One Walsh-Hadamard stage within half-blocks [BM, KB, 8]: pairs D apart -> (a+b, a-b)."""
    BM: tl.constexpr = v.shape[0]
    KB: tl.constexpr = v.shape[1]
    w = tl.reshape(v, (BM, KB, 4 // D, 2, D))
    pair = tl.arange(0, 2)
    s = tl.sum(w, axis=3)  # a + b: a single add per pair
    d = tl.sum(w * tl.where(pair == 0, 1.0, -1.0)[None, None, None, :, None], axis=3)  # a + (-b)
    w = tl.where((pair == 0)[None, None, None, :, None], s[:, :, :, None, :], d[:, :, :, None, :])
    return tl.reshape(w, (BM, KB, 8))


@triton.jit
def rht16(lo, hi, SIGN_MASK: tl.constexpr):
    """x -> x · diag(s) · H16 / 4 per block, butterflies at distance 8 (lo with hi), 4, 2, 1."""
    lane = tl.arange(0, 8)
    lo = lo * tl.where(((SIGN_MASK >> lane) & 1) != 0, -1.0, 1.0)[None, None, :]
    hi = hi * tl.where(((SIGN_MASK >> (lane + 8)) & 1) != 0, -1.0, 1.0)[None, None, :]
    lo, hi = lo + hi, lo - hi
    lo = butterfly8(butterfly8(butterfly8(lo, 4), 2), 1)
    hi = butterfly8(butterfly8(butterfly8(hi, 4), 2), 1)
    return lo * 0.25, hi * 0.25


@triton.jit
def global_scales(amax, SCALE_MAX: tl.constexpr):
    """(S_enc, S_dec) from the global amax, as formats/nvfp4.global_encode_scale."""
    s_enc = min_nan(tl.math.div_rn(SCALE_MAX * 6.0, amax), FLT_MAX)
    s_enc = tl.where((amax == 0) | (s_enc == 0), 1.0, s_enc)
    return s_enc, tl.math.div_rn(1.0, s_enc)


@triton.jit
def global_decode(amax, SCALE_MAX: tl.constexpr):
    """D from the global amax, as formats/global_scale.global_decode_scale: amax times
    fl(1 / (6 * SCALE_MAX)), or 2^-128 (= 1 / FLT_MAX) where S_enc was capped."""
    capped = (amax > 0) & (tl.math.div_rn(SCALE_MAX * 6.0, amax) > FLT_MAX)
    return tl.where(capped, CAPPED_DECODE, amax * (1.0 / (SCALE_MAX * 6.0)))


@triton.jit
def block_scale_bits(bmax, s_enc, INV_TARGET: tl.constexpr):
    return e4m3_bits(min_nan(bmax * (s_enc * INV_TARGET), 448.0))


@triton.jit
def encode_factor(scale_bits, s_dec):
    """Per block: the factor that puts x in units of its E4M3 scale."""
    return min_nan(tl.math.div_rn(1.0, e4m3_value(scale_bits) * s_dec), FLT_MAX)


@triton.jit
def round_half(y, u, STOCHASTIC: tl.constexpr):
    # No clamp to [-6, 6]: both roundings saturate by themselves, exactly as after the
    # reference's clamp.
    if STOCHASTIC:
        return e2m1_stochastic(y, u)
    else:
        return e2m1_rne(y)


@triton.jit
def pair_sum8(v):
    """Sum of [BM, KB, 8] over its last dim, pairwise at distance 1, 2, 4."""
    BM: tl.constexpr = v.shape[0]
    KB: tl.constexpr = v.shape[1]
    v = tl.sum(tl.reshape(v, (BM, KB, 4, 2)), axis=3)
    v = tl.sum(tl.reshape(v, (BM, KB, 2, 2)), axis=3)
    return tl.sum(v, axis=2)


@triton.jit
def quad_step(t, N: tl.constexpr, C: tl.constexpr):
    """[T, 2N, KB, 2C] -> [T, N, KB, C]: each 2x2 group summed as (a00 + a11) + (a01 + a10)."""
    T: tl.constexpr = t.shape[0]
    KB: tl.constexpr = t.shape[2]
    w = tl.reshape(t, (T, N, 2, KB, C, 2))
    i = tl.arange(0, 2)
    diag = (i[:, None] == i[None, :])[None, None, :, None, None, :]
    d = tl.sum(tl.sum(tl.where(diag, w, 0.0), axis=5), axis=2)  # a00 + a11 (x + 0.0 is exact)
    a = tl.sum(tl.sum(tl.where(diag, 0.0, w), axis=5), axis=2)  # a01 + a10
    return d + a


@triton.jit
def sq_error(lo, hi, val_lo, val_hi, scale_bits, dec, IS_2D: tl.constexpr):
    """Sum of (x_hat - x)^2 per block (1x16) or per 16x16 tile (repeated on its rows), x_hat
    from the E2M1 values val (float32) and the scales, in the reference's fixed order: pairwise
    in a block; a transpose-invariant quadtree in a tile."""
    BM: tl.constexpr = lo.shape[0]
    KB: tl.constexpr = lo.shape[1]
    # (value * scale) * D, in the reference's order: value * scale is exact, and only then the
    # one rounding of the product with D (value * (scale * D) rounds twice for 1.5, 3 and 6).
    s = e4m3_value(scale_bits)[:, :, None]
    err_lo = val_lo * s * dec - lo
    err_hi = val_hi * s * dec - hi
    if IS_2D:
        t_lo = tl.reshape(err_lo * err_lo, (BM // 16, 16, KB, 8))
        t_hi = tl.reshape(err_hi * err_hi, (BM // 16, 16, KB, 8))
        t_lo = quad_step(quad_step(quad_step(t_lo, 8, 4), 4, 2), 2, 1)  # [T, 2, KB, 1]
        t_hi = quad_step(quad_step(quad_step(t_hi, 8, 4), 4, 2), 2, 1)
        # Last level: rows (0, 1) x column groups (lo, hi).
        t_lo = tl.reshape(t_lo, (BM // 16, 2, KB))
        t_hi = tl.reshape(t_hi, (BM // 16, 2, KB))
        row = tl.arange(0, 2)[None, :, None]
        a00 = tl.sum(tl.where(row == 0, t_lo, 0.0), axis=1)
        a10 = tl.sum(tl.where(row == 0, 0.0, t_lo), axis=1)
        a01 = tl.sum(tl.where(row == 0, t_hi, 0.0), axis=1)
        a11 = tl.sum(tl.where(row == 0, 0.0, t_hi), axis=1)
        tile = (a00 + a11) + (a01 + a10)
        return tl.reshape(tl.broadcast_to(tile[:, None, :], (BM // 16, 16, KB)), (BM, KB))
    else:
        return pair_sum8(err_lo * err_lo) + pair_sum8(err_hi * err_hi)


@triton.jit
def four_over_six_values(lo, hi, bmax, s_enc, s_dec, dec, IS_2D: tl.constexpr):
    """Four Over Six with round to nearest, as values: (scale bits, values lo, values hi) of the
    candidate scale that maps each block's (or 16x16 tile's) maximum to 4 where its squared
    error is lower than the one mapping it to 6 (ties: 6). The values come straight from the
    rounding (`e2m1_rne_value`), with no codes in between: the fake-quantize path."""
    sbits = block_scale_bits(bmax, s_enc, 1.0 / 6.0)
    enc = encode_factor(sbits, s_dec)[:, :, None]
    v_lo = e2m1_rne_value(lo * enc)
    v_hi = e2m1_rne_value(hi * enc)
    sbits4 = block_scale_bits(bmax, s_enc, 0.25)
    enc4 = encode_factor(sbits4, s_dec)[:, :, None]
    v4_lo = e2m1_rne_value(lo * enc4)
    v4_hi = e2m1_rne_value(hi * enc4)
    use4 = (sq_error(lo, hi, v4_lo, v4_hi, sbits4, dec, IS_2D)
            < sq_error(lo, hi, v_lo, v_hi, sbits, dec, IS_2D))
    pick = use4[:, :, None]
    return (tl.where(use4, sbits4, sbits), tl.where(pick, v4_lo, v_lo),
            tl.where(pick, v4_hi, v_hi))


@triton.jit
def load_halves(x_ptr, b, rows, kbs, M, K, sb, sm, sk, HADAMARD: tl.constexpr,
                SIGN_MASK: tl.constexpr):
    """Half-blocks lo, hi [BM, KB, 8] of x (zero outside M x K) as float32, and their masks."""
    j = tl.arange(0, 8)
    col_lo = kbs[None, :, None] * 16 + j[None, None, :]
    row_ok = (rows < M)[:, None, None]
    base = x_ptr + b.to(tl.int64) * sb + rows.to(tl.int64)[:, None, None] * sm
    mask_lo = row_ok & (col_lo < K)
    mask_hi = row_ok & (col_lo + 8 < K)
    lo = tl.load(base + col_lo.to(tl.int64) * sk, mask=mask_lo, other=0.0).to(tl.float32)
    hi = tl.load(base + (col_lo + 8).to(tl.int64) * sk, mask=mask_hi, other=0.0).to(tl.float32)
    if HADAMARD:
        lo, hi = rht16(lo, hi, SIGN_MASK)
    return lo, hi, mask_lo, mask_hi


@triton.jit
def block_amax(lo, hi):
    """max |x| of each block [BM, KB], NaN-propagating like torch.amax."""
    return max_nan(abs_max(lo, 2), abs_max(hi, 2))


@triton.jit
def pack_pairs(codes):
    """[BM, KB, 8] codes -> [BM, KB, 4] bytes, the even element in the low nibble."""
    BM: tl.constexpr = codes.shape[0]
    KB: tl.constexpr = codes.shape[1]
    lo, hi = tl.split(tl.reshape(codes, (BM, KB, 4, 2)))
    return (lo | (hi << 4)).to(tl.uint8)
