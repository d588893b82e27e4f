"""Second-moment transforms for storing AdamW's v in NVFP4, as pure functions.

Raw v spans many orders of magnitude, but E2M1's non-zero codes cover only 0.5 .. 6 times a
block's scale: inside a 16-element block, values under 1/24 of the block max round to zero (RNE;
under 1/12 they may, with stochastic rounding), and a zero v turns the update
m / (sqrt(v) + eps) into m / eps. A transform maps v to a non-negative `stored` value whose spread
inside a block is smaller; the optimizer quantizes `stored` and reads v back through the inverse.

Each transform is a pair `encode(v) -> stored`, `decode(stored) -> v` (fp32 in, fp32 out), exact
inverses up to fp32 rounding: "v" (v itself: a block keeps a 12x range of v), "sqrt" (144x),
"pow4" (v^(1/4): ~2e4x, at 4x the relative error), "log" (log(v + t) - log(t): an absolute
grid), "rsqrt" (1 / (sqrt(v) + c)), "rank1" and "sqrt-center-hadamard" (both below, with side
factors kept in fp32). Quantization still rounds small stored values to
zero; `floor_zeros` lifts each zero to the largest value it can stand for (`block_floor`). For
the increasing transforms that means v is overestimated, a smaller (safe) step; for "rsqrt" it
means a smaller v, a larger step, which is why rsqrt is kept only as a measured counter-example.

"rank1" (after lpmm's rank-1 normalisation, with Adafactor's estimate) divides v by the outer
product n = R C^T / mean(v) of its row and column means, whose square roots it keeps in fp32
(4 bytes per row and per column): the separable part of v (a gradient delta x^T has
v ~ delta^2 x^2, spanning as many decades along a block as the inputs x do, and across rows as
the rows' gradients do) never reaches the quantizer. It stores sqrt(v) x (1 / sqrt(n)) and
reads the root of v back as stored x sqrt(n), so decoding rounds no square root of its own.
How the transforms compare in training: docs/results/optimizers.md.

"sqrt-center-hadamard" (Full-Stack FP4's transform of v) stores H(sqrt(v) - mu): the root of v
minus its tensor mean mu (an fp32 side factor), through the 16-point random Hadamard transform
of formats/hadamard.py over the quantizer's blocks. A block of roots is one offset plus small
deviations; removing the offset and spreading the deviations over all 16 codes leaves values of
like magnitude, which E2M1 quantizes with a smaller error than the raw roots. The stored values
are signed, so no zero is lifted to a floor; decoding is the exact inverse (inverse transform,
add mu, clamp at 0, square). Why one mean per tensor: docs/results/optimizers.md.

Rounding is pinned down so that the fused Triton step (fp4stack/kernels/adamw4.py) gives the same
bits: square roots are correctly rounded (`sqrt_rn`), and the roots of the rank-1 factors come
from float64 sums through float64 operations rounded once to float32, so the order in which the
kernel adds its tiles does not show (in practice: see `rank1_roots`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..api import dequantize
from ..formats.hadamard import rht, rht_inverse
from ..formats.tensor import BLOCK, NVFP4Tensor

# Offset of the log transform: v below this is indistinguishable from 0 (fp32 normals end at
# 1.2e-38, so log(v + LOG_TINY) is exact enough for every v that matters to Adam).
LOG_TINY = 1e-30
_LOG_OFFSET = math.log(LOG_TINY)
# Added to sqrt(v) by the rsqrt transform so v = 0 stores a finite 1 / RSQRT_C.
RSQRT_C = 1e-8
# A block whose E4M3 scale rounded to zero had max <= 6 * 2^-10 (scale units): the scale whose
# E2M1 half-step (0.5 * scale) equals that bound.
_ZERO_SCALE_BOUND = 12 * 2.0**-10
_SQRT_FLT_MAX = math.sqrt(torch.finfo(torch.float32).max)


def sqrt_rn(x: Tensor) -> Tensor:
    """Correctly rounded float32 square root on every device (through float64, which rounds
    exactly for a square root): torch's CPU sqrt (AVX-512) is off by one ulp on ~1 value in 6,
    and the fused kernel rounds exactly."""
    return x.double().sqrt().to(x.dtype)


def encode_v(v: Tensor) -> Tensor:
    return v


def decode_v(stored: Tensor) -> Tensor:
    return stored


def encode_sqrt(v: Tensor) -> Tensor:
    return sqrt_rn(v)


def decode_sqrt(stored: Tensor) -> Tensor:
    return stored * stored


def encode_pow4(v: Tensor) -> Tensor:
    return sqrt_rn(sqrt_rn(v))


def decode_pow4(stored: Tensor) -> Tensor:
    sq = stored * stored
    return sq * sq


def encode_log(v: Tensor) -> Tensor:
    # Shifted so v = 0 stores 0 and every stored value is >= 0 (NVFP4's scale is set by |x|).
    return torch.log(v + LOG_TINY) - _LOG_OFFSET


def decode_log(stored: Tensor) -> Tensor:
    # exp(log(t)) - t can come out a hair below zero in fp32.
    return torch.clamp(torch.exp(stored + _LOG_OFFSET) - LOG_TINY, min=0.0)


def encode_rsqrt(v: Tensor) -> Tensor:
    return 1.0 / (sqrt_rn(v) + RSQRT_C)


def decode_rsqrt(stored: Tensor) -> Tensor:
    # stored = 0 would be v = inf; capped at fp32 max so the EMA stays finite.
    root = torch.clamp(1.0 / stored - RSQRT_C, min=0.0, max=_SQRT_FLT_MAX)
    return root * root


def _roots(f: Tensor) -> tuple[Tensor, Tensor]:
    """sqrt(f) and 1 / sqrt(f) of a float64 factor, each rounded once to float32 (0 and 0 where
    f is 0)."""
    root = f.sqrt()
    positive = root > 0
    inv = torch.where(positive, 1.0 / torch.where(positive, root, torch.ones_like(root)), 0.0)
    return root.float(), inv.float()


def rank1_roots(v: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Square roots of the rank-1 factors of v viewed as [rows, K] (leading dims flattened), and
    their reciprocals: (row_root, row_inv, col_root, col_inv), float32, 0 where a factor is 0.

    The factors are Adafactor's: row means over the total mean, and column means, so that the
    estimate of v is their outer product and its square root the outer product of the roots.
    The sums are float64, and the means, ratio, roots and reciprocals float64 operations, each
    root and reciprocal rounded once to float32: a float32 sum depends on its order, while
    float64 sums of float32 values round to the same float32 roots in any order in practice (an
    error of ~1e-16 relative would have to straddle a float32 rounding boundary), so the fused
    kernel, which adds tiles atomically in whatever order they finish, gets the same ones. Means
    multiply by the reciprocal of the count (each op rounded once, the same on every device).
    """
    v2 = v.reshape(-1, v.shape[-1]).double()
    rows, k = v2.shape
    total = v2.sum() * (1.0 / (rows * k))
    inv_total = 1.0 / torch.where(total > 0, total, torch.ones_like(total))
    row = (v2.sum(dim=1) * (1.0 / k)) * inv_total
    return (*_roots(row), *_roots(v2.sum(dim=0) * (1.0 / rows)))


def outer(row: Tensor, col: Tensor, shape: torch.Size) -> Tensor:
    """row x col^T (float32 products) in the shape of the [rows, K]-viewed tensor."""
    return (row[:, None] * col[None, :]).reshape(shape)


def safe_divide(x: Tensor, d: Tensor) -> Tensor:
    """x / d for d >= 0, with 0 where d is 0 (for v over its rank-1 estimate, x is 0 there too:
    v > 0 makes its row and column means positive)."""
    positive = d > 0
    return torch.where(positive, x / torch.where(positive, d, torch.ones_like(d)), 0.0)


@dataclass(frozen=True)
class Transform:
    """A named encode/decode pair for the second moment.

    factored: the stored value is encode(v / n) for v's rank-1 estimate n (computed through the
    roots of its factors, which the caller keeps: see encode_state).
    centered: the stored value is the Hadamard transform of encode(v) minus its tensor mean,
    which the caller keeps; encode and decode are then the element-wise part (sqrt).
    """

    name: str
    encode: Callable[[Tensor], Tensor]
    decode: Callable[[Tensor], Tensor]
    factored: bool = False
    centered: bool = False

    @property
    def side(self) -> tuple[str, ...]:
        """Names of the fp32 side factors encode_state returns, in order (none for most)."""
        if self.factored:
            return ("row", "col")
        return ("mean",) if self.centered else ()


TRANSFORMS: dict[str, Transform] = {
    t.name: t
    for t in (
        Transform("v", encode_v, decode_v),
        Transform("sqrt", encode_sqrt, decode_sqrt),
        Transform("pow4", encode_pow4, decode_pow4),
        Transform("log", encode_log, decode_log),
        Transform("rsqrt", encode_rsqrt, decode_rsqrt),
        Transform("rank1", encode_sqrt, decode_sqrt, factored=True),
        Transform("sqrt-center-hadamard", encode_sqrt, decode_sqrt, centered=True),
    )
}


def get_transform(name: str) -> Transform:
    if name not in TRANSFORMS:
        raise ValueError(
            f"unknown second-moment transform {name!r}; choose from {list(TRANSFORMS)}"
        )
    return TRANSFORMS[name]


def block_floor(q: NVFP4Tensor) -> Tensor:
    """Per element, an upper bound of what a zero code of its 1x16 block can stand for (fp32,
    q.shape): lifting zeros to it overestimates v, so the step m / sqrt(v) only shrinks.

    A zero code under a block scale s means |x| <= s/4 (RNE) or < s/2 (stochastic): the bound
    is s/2, E2M1's smallest non-zero value. A zero block scale means the block max was at most
    6 * 2^-10 in scale units (2^-10, half the smallest E4M3 subnormal, ties to 0).
    """
    scales = q.scales.to(torch.float32)
    scales = torch.where(scales == 0, _ZERO_SCALE_BOUND, scales)
    floor = (0.5 * scales * q.decode_scale).repeat_interleave(BLOCK, dim=-1)
    return floor[..., : q.shape[-1]]


def floor_zeros(stored: Tensor, floor: Tensor) -> Tensor:
    """`stored` with its exact zeros replaced by `floor` (both non-negative)."""
    return torch.where(stored == 0, floor, stored)


Factors = tuple[Tensor, ...] | None


def tensor_mean(x: Tensor) -> Tensor:
    """The mean of x as a 0-d float32 tensor: a float64 sum, so that it does not depend on the
    order of the additions (see rank1_roots), rounded once."""
    return (x.double().sum() * (1.0 / max(x.numel(), 1))).float()


def encode_state(v: Tensor, transform: Transform) -> tuple[Tensor, Factors]:
    """The tensor to quantize for v (fp32), and the fp32 side factors (transform.side) kept to
    decode it: a factored transform's roots of the rank-1 factors (row_root, col_root), with
    sqrt(v) over the root of the estimate stored; a centered one's (mean,) of sqrt(v), with the
    Hadamard transform of sqrt(v) - mean stored."""
    if transform.centered:
        root = sqrt_rn(v)
        mean = tensor_mean(root)
        return rht(root - mean), (mean,)
    if not transform.factored:
        return transform.encode(v), None
    row_root, row_inv, col_root, col_inv = rank1_roots(v)
    return sqrt_rn(v) * outer(row_inv, col_inv, v.shape), (row_root, col_root)


def read_state(q: NVFP4Tensor, transform: Transform, factors: Factors = None
               ) -> tuple[Tensor, Tensor]:
    """v (fp32) from its quantized stored form, and its square root: exact zeros lifted to their
    block's floor, then the inverse transform. A factored transform's root is the stored value
    times the root of the estimate (no square root to round) and v its square; the others' root
    is sqrt_rn(v). A centered transform's stored values are signed: nothing is lifted; its root
    is the inverse Hadamard transform plus the mean, clamped at 0, and v its square."""
    if transform.centered:
        if factors is None:
            raise ValueError(f"transform {transform.name!r} needs its mean to decode")
        root = torch.clamp(rht_inverse(dequantize(q)) + factors[0], min=0.0)
        return root * root, root
    x = floor_zeros(dequantize(q), block_floor(q))
    if not transform.factored:
        v = transform.decode(x)
        return v, sqrt_rn(v)
    if factors is None:
        raise ValueError(f"transform {transform.name!r} needs its rank-1 factors to decode")
    root = x * outer(*factors, q.shape)
    return root * root, root


def decode_state(q: NVFP4Tensor, transform: Transform, factors: Factors = None) -> Tensor:
    """v (fp32) from its quantized stored form (see read_state)."""
    return read_state(q, transform, factors)[0]
