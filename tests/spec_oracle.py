"""A slow, scalar, independent transcription of docs/NVFP4_SPEC.md (the test oracle).

Nothing here imports fp4stack. Every float operation is one numpy float32 scalar operation, in the
order the specification writes it; E4M3 rounding is written from the E4M3 bit layout, E2M1 rounding
from the spec's table. Tests compare the torch reference against this bit for bit.

Where the spec is silent, the oracle follows the documented choices of fp4stack's reference:
  - Four Over Six (MSE): the squared errors of a block's 16 elements are summed pairwise
    (distance-1 pairs first, then 2, 4, 8); the map-to-4 candidate wins only when strictly better.
    16x16 tiles choose once per tile (they share one scale): the 256 squared errors are summed as
    a quadtree of 2x2 groups, each (top-left + bottom-right) + (top-right + bottom-left), an order
    that transposing the tile does not change (so W and W^T choose alike).
  - -0.0 gets E2M1 code 0 (as in Transformer Engine); only y < 0 sets the sign bit.
  - Stochastic rounding draws come from the counter hash in formats/random.py (re-implemented
    here on numpy uint32): element (row r, column c) of the [rows, K] view uses index r * Kp + c.
"""

from __future__ import annotations

import bisect
import math
from fractions import Fraction

import numpy as np

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
BLOCK = 16


# ---------------------------------------------------------------------------------------------
# E4M3 (float8_e4m3fn): sign | 4 exponent bits (bias 7) | 3 mantissa bits. Exponent 0 encodes
# subnormals m * 2^-9; S.1111.111 is NaN; there is no infinity, so the max is 1.75 * 2^8 = 448.
# ---------------------------------------------------------------------------------------------
def e4m3_byte_to_float(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man * 2.0**-9
    return sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)


# The non-negative finite codes 0x00..0x7E, whose values increase with the code.
_E4M3_POS = [e4m3_byte_to_float(b) for b in range(0x7F)]
assert all(a < b for a, b in zip(_E4M3_POS[:-1], _E4M3_POS[1:], strict=True))
assert _E4M3_POS[-1] == 448.0


def e4m3_rne(v: np.float32) -> int:
    """E4M3 byte of float32 v (|v| <= 448 or NaN) by round-to-nearest, ties to even mantissa."""
    v = F32(v)
    if np.isnan(v):
        return 0x7F
    sign = 0x80 if np.signbit(v) else 0x00
    a = float(abs(v))
    assert a <= 448.0, "e4m3_rne takes clamped values"
    lo = bisect.bisect_right(_E4M3_POS, a) - 1  # largest code whose value is <= a
    if _E4M3_POS[lo] == a:
        return sign | lo
    hi = lo + 1
    mag = Fraction(a)
    d_lo = mag - Fraction(_E4M3_POS[lo])
    d_hi = Fraction(_E4M3_POS[hi]) - mag
    if d_lo < d_hi:
        code = lo
    elif d_hi < d_lo:
        code = hi
    else:
        code = lo if lo % 2 == 0 else hi  # tie: even mantissa (the code's lowest bit)
    return sign | code


# ---------------------------------------------------------------------------------------------
# E2M1, from the spec's table (after clamping to [-6, 6]).
# ---------------------------------------------------------------------------------------------
def e2m1_rne(y: np.float32) -> int:
    y = F32(y)
    assert not np.isnan(y), "the oracle does not model NaN"
    a = abs(float(y))
    if a <= 0.25:
        mag = 0
    elif a < 0.75:
        mag = 1
    elif a <= 1.25:
        mag = 2
    elif a < 1.75:
        mag = 3
    elif a <= 2.5:
        mag = 4
    elif a < 3.5:
        mag = 5
    elif a <= 5.0:
        mag = 6
    else:
        mag = 7
    return mag | (8 if y < 0 else 0)


def e2m1_stochastic(y: np.float32, u: np.float32) -> int:
    """Round |y| up to the next grid value with probability (|y| - lo) / (hi - lo), exactly."""
    y = F32(y)
    a = Fraction(float(abs(y)))
    lo = max(i for i, g in enumerate(E2M1_GRID) if Fraction(g) <= a)
    mag = lo
    if lo < 7:
        gap = Fraction(E2M1_GRID[lo + 1]) - Fraction(E2M1_GRID[lo])
        if Fraction(float(u)) < (a - Fraction(E2M1_GRID[lo])) / gap:
            mag = lo + 1
    return mag | (8 if y < 0 else 0)


def e2m1_value(code: int) -> np.float32:
    v = F32(E2M1_GRID[code & 7])
    return -v if code & 8 else v


def pack(codes: list[int]) -> list[int]:
    return [codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(len(codes) // 2)]


# ---------------------------------------------------------------------------------------------
# Counter-based uniform draws (formats/random.py), on numpy uint32 with wrap-around arithmetic.
# ---------------------------------------------------------------------------------------------
def lowbias32_np(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.uint32)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x7FEB352D)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x846CA68B)
        x = x ^ (x >> np.uint32(16))
    return x


def uniform_np(index: np.ndarray, seed: int) -> np.ndarray:
    def h(v: int) -> int:
        return int(lowbias32_np(np.uint32(v & 0xFFFFFFFF)))

    k1 = h(seed ^ (seed >> 32))
    k2 = h(k1 ^ 0x9E3779B9)
    index = np.asarray(index, dtype=np.uint64)
    lo = (index & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    hi = (index >> np.uint64(32)).astype(np.uint32)
    bits = lowbias32_np(lowbias32_np(lo ^ np.uint32(k1)) ^ np.uint32(k2) ^ hi)
    return (bits >> np.uint32(8)).astype(np.float32) * F32(2.0**-24)


# ---------------------------------------------------------------------------------------------
# The quantizer.
# ---------------------------------------------------------------------------------------------
def global_encode_scale(amax: np.float32, scale_max: float) -> np.float32:
    with np.errstate(divide="ignore", over="ignore"):
        s_enc = F32(scale_max * 6) / F32(amax)
    s_enc = min(s_enc, FLT_MAX)
    if amax == 0 or s_enc == 0:
        s_enc = F32(1)
    return F32(s_enc)


def global_decode_scale(amax: np.float32, scale_max: float) -> np.float32:
    """amax * (1/(6 * scale_max)); where 6 * scale_max / amax overflows (S_enc capped at
    FLT_MAX) the inverse of the capped scale, fl32(1 / FLT_MAX) = 2^-128, instead."""
    with np.errstate(divide="ignore", over="ignore"):
        capped = amax > 0 and F32(scale_max * 6) / F32(amax) > FLT_MAX
    return F32(F32(1) / FLT_MAX) if capped else F32(F32(amax) * (F32(1) / F32(6 * scale_max)))


def _encode_block(xs, s_byte, s_dec, us):
    with np.errstate(divide="ignore", over="ignore"):
        enc = F32(1) / (F32(e4m3_byte_to_float(s_byte)) * s_dec)
    enc = min(enc, FLT_MAX)
    codes = []
    for i, xv in enumerate(xs):
        with np.errstate(over="ignore"):
            y = xv * enc
        y = F32(min(max(y, F32(-6)), F32(6)))
        codes.append(e2m1_rne(y) if us is None else e2m1_stochastic(y, us[i]))
    return codes


def _sq_errors(xs, codes, s_byte, dec):
    s = F32(e4m3_byte_to_float(s_byte))
    out = []
    for xv, c in zip(xs, codes, strict=True):
        with np.errstate(over="ignore"):
            err = e2m1_value(c) * s * dec - xv
            out.append(err * err)
    return out


def _pairwise_sum(sq):
    # distance-1 pairs first, then 2, 4, 8
    while len(sq) > 1:
        with np.errstate(over="ignore"):  # huge blocks: both candidates' errors may be inf
            sq = [sq[2 * i] + sq[2 * i + 1] for i in range(len(sq) // 2)]
    return sq[0]


def _quadtree_sum(sq):
    # sq: 16x16 nested lists [row][col]; each 2x2 group adds (tl + br) + (tr + bl).
    while len(sq) > 1:
        n = len(sq) // 2
        with np.errstate(over="ignore"):
            sq = [
                [
                    (sq[2 * i][2 * j] + sq[2 * i + 1][2 * j + 1])
                    + (sq[2 * i][2 * j + 1] + sq[2 * i + 1][2 * j])
                    for j in range(n)
                ]
                for i in range(n)
            ]
    return sq[0][0]


def _scale_byte(bmax, s_enc, target):
    v = bmax * (s_enc * (F32(1) / F32(target)))
    return e4m3_rne(F32(min(max(v, F32(-448)), F32(448))))


def quantize(
    x: np.ndarray,
    *,
    tile_2d: bool = False,
    four_over_six: bool = False,
    amax: float | None = None,
    seed: int | None = None,
):
    """Oracle NVFP4 quantization of float32 `x` [..., rows, K] (or [K]) along the last dim.

    Returns (data bytes uint8 [..., Kp/2], scale bytes uint8 [..., Kp/16], amax float32), where
    Kp is K rounded up to a multiple of 16. `seed` selects stochastic rounding.
    """
    x = np.asarray(x, dtype=np.float32)
    shape = x.shape
    k = shape[-1]
    kp = -(-k // BLOCK) * BLOCK
    rows = x.reshape(-1, k) if k else np.zeros((int(np.prod(shape[:-1])), 0), np.float32)
    n_rows = rows.shape[0]
    scale_max = 256.0 if four_over_six else 448.0

    if amax is None:
        amax_f = F32(0)
        for v in x.reshape(-1):
            amax_f = max(amax_f, abs(F32(v)))
    else:
        amax_f = F32(amax)
    s_enc = global_encode_scale(amax_f, scale_max)
    s_dec = F32(1) / s_enc
    dec = global_decode_scale(amax_f, scale_max)

    padded = [[F32(v) for v in r] + [F32(0)] * (kp - k) for r in rows]
    us = None
    if seed is not None:
        idx = np.arange(n_rows * kp, dtype=np.uint64)
        us = uniform_np(idx, seed).reshape(n_rows, kp)

    n_blocks = kp // BLOCK
    bmax = [[F32(0)] * n_blocks for _ in range(n_rows)]
    for r in range(n_rows):
        for b in range(n_blocks):
            m = F32(0)
            for v in padded[r][b * BLOCK : (b + 1) * BLOCK]:
                m = max(m, abs(v))
            bmax[r][b] = m
    if tile_2d:
        # One scale per 16x16 tile of each [rows, K] matrix (rows padded with zeros).
        rows_per_mat = max(shape[-2], 1)
        for m0 in range(0, n_rows, rows_per_mat):
            for t0 in range(m0, m0 + rows_per_mat, BLOCK):
                t1 = min(t0 + BLOCK, m0 + rows_per_mat)
                for b in range(n_blocks):
                    m = F32(0)
                    for r in range(t0, t1):
                        m = max(m, bmax[r][b])
                    for r in range(t0, t1):
                        bmax[r][b] = m

    # Both candidates for every 1x16 block: (scale byte, codes, squared errors).
    cand = {}
    for r in range(n_rows):
        for b in range(n_blocks):
            xs = padded[r][b * BLOCK : (b + 1) * BLOCK]
            ub = None if us is None else us[r, b * BLOCK : (b + 1) * BLOCK]
            for target in (6, 4) if four_over_six else (6,):
                sb = _scale_byte(bmax[r][b], s_enc, target)
                cs = _encode_block(xs, sb, s_dec, ub)
                cand[r, b, target] = (sb, cs, _sq_errors(xs, cs, sb, dec))

    # The 4/6 choice: per 1x16 block, or per 16x16 tile (padded rows contribute zero error).
    use4 = {}
    if four_over_six and not tile_2d:
        for (r, b, target), (_, _, sq) in cand.items():
            if target == 6:
                use4[r, b] = _pairwise_sum(cand[r, b, 4][2]) < _pairwise_sum(sq)
    elif four_over_six:
        rows_per_mat = max(shape[-2], 1)
        for m0 in range(0, n_rows, rows_per_mat):
            for t0 in range(m0, m0 + rows_per_mat, BLOCK):
                t_rows = range(t0, min(t0 + BLOCK, m0 + rows_per_mat))
                for b in range(n_blocks):
                    err = {}
                    for target in (6, 4):
                        tile = [cand[r, b, target][2] for r in t_rows]
                        tile += [[F32(0)] * BLOCK] * (BLOCK - len(tile))
                        err[target] = _quadtree_sum(tile)
                    for r in t_rows:
                        use4[r, b] = err[4] < err[6]  # ties go to map-to-6

    data = np.zeros((n_rows, kp // 2), np.uint8)
    scales = np.zeros((n_rows, n_blocks), np.uint8)
    for r in range(n_rows):
        codes_row = []
        for b in range(n_blocks):
            sb, cs, _ = cand[r, b, 4 if use4.get((r, b), False) else 6]
            scales[r, b] = sb
            codes_row.extend(cs)
        data[r] = pack(codes_row)
    return (
        data.reshape(*shape[:-1], kp // 2),
        scales.reshape(*shape[:-1], n_blocks),
        amax_f,
    )


def dequantize(data: np.ndarray, scales: np.ndarray, amax: np.float32, k: int,
               scale_max: float = 448.0) -> np.ndarray:
    """x_hat = e2m1(code) * float(s_b) * D, float32, cut to K (D: global_decode_scale)."""
    dec = global_decode_scale(F32(amax), scale_max)
    lead = data.shape[:-1]
    d2 = data.reshape(-1, data.shape[-1])
    s2 = scales.reshape(-1, scales.shape[-1])
    out = np.zeros((d2.shape[0], d2.shape[1] * 2), np.float32)
    for r in range(d2.shape[0]):
        for j in range(d2.shape[1] * 2):
            byte = int(d2[r, j // 2])
            code = (byte >> 4) if j % 2 else (byte & 0xF)
            s = F32(e4m3_byte_to_float(int(s2[r, j // BLOCK])))
            with np.errstate(over="ignore"):
                out[r, j] = e2m1_value(code) * s * dec
    return out[:, :k].reshape(*lead, k)
