"""NVFP4 quantize / dequantize: the readable torch reference of the specification.

This file is the definition of fp4stack's numerics. The Triton kernels reproduce it bit for bit
and are tested against it; every step below is float32, in the order the specification gives.
"""

from __future__ import annotations

import torch

from . import e2m1
from .global_scale import E4M3_MAX, FLT_MAX, global_decode_scale, global_encode_scale
from .hadamard import rht
from .random import draw_seed_tensor, uniform
from .spec import QuantSpec
from .tensor import BLOCK, NVFP4Tensor, padded_k

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _f32(v: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32, device=like.device)


def check_input(x: torch.Tensor, spec: QuantSpec, name: str) -> None:
    """Shape and dtype checks shared by every backend."""
    if spec.format != "nvfp4":
        raise ValueError(
            f"{name}: quantize produces NVFP4, but the spec has format={spec.format!r}; use "
            "fake_quantize (which handles every format) or quantize_fp8"
        )
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: NVFP4 quantizes float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < (2 if spec.is_2d else 1):
        raise ValueError(
            f"{name}: block={spec.block} needs at least {2 if spec.is_2d else 1} dims, "
            f"got shape {tuple(x.shape)}"
        )
    if spec.hadamard and x.shape[-1] % BLOCK:
        raise ValueError(
            f"{name}: hadamard=True needs the last dim to be a multiple of 16, got "
            f"{x.shape[-1]} (shape {tuple(x.shape)}); pad the tensor or drop the transform"
        )


def check_pair(x: torch.Tensor, spec: QuantSpec, spec_t: QuantSpec, cols_t: int,
               name: str) -> None:
    """check_input for a matrix x quantized along its rows by `spec` and, transposed and
    zero-padded to `cols_t` columns (at most to whole blocks), along its columns by `spec_t`."""
    check_input(x, spec, name)
    m = x.shape[0]
    if x.dim() != 2 or not m <= cols_t <= m + (-m % BLOCK):
        raise ValueError(f"{name}: a pair takes a matrix and cols_t in [{m}, {m + (-m % BLOCK)}]"
                         f" (its rows, padded to whole blocks at most), got shape "
                         f"{tuple(x.shape)} and cols_t={cols_t}")
    check_input(x.new_empty(0, cols_t), spec_t, f"{name} (column-wise)")


def count_nonfinite(x: torch.Tensor) -> int:
    return int((~torch.isfinite(x)).sum().item())


def raise_nonfinite(count: int, x: torch.Tensor, name: str) -> None:
    if count:
        raise ValueError(
            f"{name}: {count} of {x.numel()} values are NaN or Inf; NVFP4 has no encoding for "
            "them. Fix the producer of this tensor, or pass nan_policy='propagate' to quantize "
            "anyway (NaN then spreads through the scales it touches)"
        )


def raise_transform_overflow(x: torch.Tensor, name: str) -> None:
    """For finite `x` whose 16-point Hadamard transform is not finite in float32."""
    big = float(x.detach().abs().amax())
    raise ValueError(
        f"{name}: its 16-point Hadamard transform overflows float32 (max |x| = {big:.3g}; the "
        "transform's sums grow a block's values by up to 16x before its 1/4 scale). Scale the "
        "tensor down first, or pass nan_policy='propagate' (the blocks that overflow become NaN)"
    )


def raise_if_flagged(flagged: bool, x: torch.Tensor, name: str) -> None:
    """A finite check of the values quantized (after the Hadamard transform, if any) flagged
    something: the raw input tells a NaN or Inf in it from a transform that overflowed."""
    if flagged:
        raise_nonfinite(count_nonfinite(x), x, name)
        raise_transform_overflow(x, name)


def as_amax(amax: float | torch.Tensor, device: torch.device, check: bool = True) -> torch.Tensor:
    """A caller-imposed global amax as a float32 0-d tensor on `device`.

    A float is always checked. A tensor is checked when `check` is set (nan_policy="raise"),
    which reads it on the host; under "propagate" it is trusted, so no sync happens.
    """
    if isinstance(amax, torch.Tensor):
        if amax.numel() != 1:
            raise ValueError(f"amax must be a scalar, got shape {tuple(amax.shape)}")
        amax_t = amax.detach().reshape(()).to(device=device, dtype=torch.float32)
        if check:
            _check_amax(float(amax_t.item()))
        return amax_t
    _check_amax(float(amax))
    return torch.tensor(float(amax), dtype=torch.float32, device=device)


def row_amax(xf: torch.Tensor) -> torch.Tensor:
    """float32 [..., 1]: each row's max |x| (0 for an empty row), a row-scaled spec's amax."""
    if xf.shape[-1] == 0:
        return xf.new_zeros((*xf.shape[:-1], 1))
    return xf.abs().amax(dim=-1, keepdim=True)


def refuse_row_amax(amax, name: str) -> None:
    """A row-scaled spec computes each row's amax: an imposed one has no meaning there."""
    if amax is not None:
        raise ValueError(
            f"{name}: QuantSpec.global_scale='row' takes each row's own amax; pass amax=None, "
            "or use global_scale='tensor' to impose one (a static or shared amax)"
        )


def _check_amax(amax: float) -> None:
    if not (amax >= 0.0 and amax < float("inf")):
        raise ValueError(f"amax must be finite and >= 0, got {amax}")


def block_scale(bmax: torch.Tensor, s_enc: torch.Tensor, target: float) -> torch.Tensor:
    """E4M3 block scale mapping a block max of `bmax` to `target` (6, or 4 for 4/6)."""
    v = bmax * (s_enc * _f32(1.0 / target, s_enc))
    return torch.clamp(v, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _encode(xb: torch.Tensor, s: torch.Tensor, s_dec: torch.Tensor, u: torch.Tensor | None):
    """Codes of blocks xb [..., 16] under E4M3 scales s [...]."""
    enc = torch.clamp(1.0 / (s.to(torch.float32) * s_dec), max=FLT_MAX)
    y = torch.clamp(xb * enc[..., None], -e2m1.E2M1_MAX, e2m1.E2M1_MAX)
    return e2m1.round_rne(y) if u is None else e2m1.round_stochastic(y, u)


def _block_sq_error(xb, codes, s, dec):
    # Sum over the 16 elements of (x_hat - x)^2, added pairwise (distance 1, 2, 4, 8 within the
    # block) so the float32 result does not depend on a reduction order.
    err = e2m1.code_to_value(codes) * s.to(torch.float32)[..., None] * dec - xb
    sq = err * err
    while sq.shape[-1] > 1:
        sq = sq[..., 0::2] + sq[..., 1::2]
    return sq[..., 0]


def _tile_sq_error(xb, codes, s, dec):
    # 16x16 tiles choose 4/6 per tile (they share one scale). xb: [..., R, KB, 16] -> [..., R, KB],
    # each row holding its tile's sum of (x_hat - x)^2 over 256 elements, added as a quadtree of
    # 2x2 groups, each (top-left + bottom-right) + (top-right + bottom-left): every partial sum
    # is unchanged by transposing the tile, so W and W^T make the same choice bit for bit.
    err = e2m1.code_to_value(codes) * s.to(torch.float32)[..., None] * dec - xb
    sq = err * err
    *lead, r, kb, _ = sq.shape
    t = sq.reshape(*lead, r // BLOCK, BLOCK, kb, BLOCK).transpose(-3, -2)
    while t.shape[-1] > 1:
        a00, a01 = t[..., 0::2, 0::2], t[..., 0::2, 1::2]
        a10, a11 = t[..., 1::2, 0::2], t[..., 1::2, 1::2]
        t = (a00 + a11) + (a01 + a10)
    return t[..., 0, 0].repeat_interleave(BLOCK, dim=-2)


def _block_amax(xb: torch.Tensor, is_2d: bool) -> torch.Tensor:
    # xb: [..., R, KB, 16] -> [..., R, KB]; for 16x16 tiles, max over 16 rows too, repeated.
    bmax = xb.abs().amax(dim=-1)
    if not is_2d:
        return bmax
    *lead, r, kb = bmax.shape
    tile = bmax.reshape(*lead, r // BLOCK, BLOCK, kb).amax(dim=-2)
    return tile.repeat_interleave(BLOCK, dim=-2)


def quantize(
    x: torch.Tensor,
    spec: QuantSpec = QuantSpec(),
    *,
    amax: float | torch.Tensor | None = None,
    seed: int | torch.Tensor | None = None,
    name: str = "input",
) -> NVFP4Tensor:
    """Reference NVFP4 quantization of `x` along its last dim (see NVFP4_SPEC)."""
    check_input(x, spec, name)
    check = spec.nan_policy == "raise"
    if check and not spec.hadamard:
        raise_nonfinite(count_nonfinite(x), x, name)
    shape = x.shape
    k, kp = shape[-1], padded_k(shape[-1])
    rows = shape[-2] if spec.is_2d else 1
    rows_p = padded_k(rows) if spec.is_2d else 1

    xf = x.detach().to(torch.float32)
    xf = torch.nn.functional.pad(xf, (0, kp - k, 0, rows_p - rows) if spec.is_2d else (0, kp - k))
    if spec.hadamard:
        xf = rht(xf)
        if check:  # one check of what is quantized, as the kernels do
            raise_if_flagged(bool(count_nonfinite(xf)), x, name)
    if spec.row_scaled:
        refuse_row_amax(amax, name)
        amax_t = row_amax(xf)
    elif amax is None:
        amax_t = xf.abs().amax() if xf.numel() else _f32(0.0, xf)
    else:
        amax_t = as_amax(amax, x.device, check=spec.nan_policy == "raise")

    s_enc = global_encode_scale(amax_t, spec.scale_max)
    s_dec = 1.0 / s_enc
    xb = xf.reshape(*xf.shape[:-1], kp // BLOCK, BLOCK)
    bmax = _block_amax(xb, spec.is_2d)

    u = None
    if spec.rounding == "stochastic":
        # A tensor draw (the same as draw_seed's) reads nothing back: torch.compile traces it.
        seed = draw_seed_tensor() if seed is None else seed
        # Element (row r, column c) of the logical [..., rows, K] tensor draws index r * Kp + c.
        n_rows = shape[:-1].numel()
        index = torch.arange(n_rows * kp, device=x.device, dtype=torch.int64)
        u = uniform(index, seed).reshape(*shape[:-1], kp)
        if spec.is_2d:
            u = torch.nn.functional.pad(u, (0, 0, 0, rows_p - rows))
        u = u.reshape(xb.shape)

    scales = block_scale(bmax, s_enc, e2m1.E2M1_MAX)
    codes = _encode(xb, scales, s_dec, u)
    if spec.four_over_six:
        scales4 = block_scale(bmax, s_enc, 4.0)
        codes4 = _encode(xb, scales4, s_dec, u)
        # [..., 1, 1] per row (a 0-d amax gives [1]), against the blocks' [..., KB, 16].
        dec = global_decode_scale(amax_t, spec.scale_max)[..., None]
        sq_error = _tile_sq_error if spec.is_2d else _block_sq_error
        use4 = sq_error(xb, codes4, scales4, dec) < sq_error(xb, codes, scales, dec)
        scales = torch.where(use4, scales4.view(torch.uint8), scales.view(torch.uint8))
        scales = scales.view(torch.float8_e4m3fn)
        codes = torch.where(use4[..., None], codes4, codes)

    scales = _canonical_nan(scales)
    data = e2m1.pack(codes.reshape(*xf.shape[:-1], kp))
    if spec.is_2d:
        data, scales = data[..., :rows, :], scales[..., :rows, :]
    return NVFP4Tensor(
        data=data.contiguous(), scales=scales.contiguous(), amax=amax_t, shape=shape, spec=spec
    )


def _canonical_nan(scales: torch.Tensor) -> torch.Tensor:
    # One NaN encoding (0x7F) whatever the sign of the NaN that produced it.
    bits = scales.view(torch.uint8)
    return torch.where((bits & 0x7F) == 0x7F, 0x7F, bits).to(torch.uint8).view(torch.float8_e4m3fn)


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x_hat = e2m1(code) * scale * D, in float32, then cast to dtype (D: `t.decode_scale`).

    With hadamard=True the result stays in the transformed domain (what a GEMM consumes);
    `fp4stack.rht_inverse` maps it back.
    """
    codes = e2m1.unpack(t.data)
    vals = e2m1.code_to_value(codes).reshape(*t.scales.shape, BLOCK)
    x = vals * t.scales.to(torch.float32)[..., None] * t.decode_scale[..., None]
    x = x.reshape(codes.shape)[..., : t.shape[-1]]
    return x.to(dtype)


def fake_quantize(
    x: torch.Tensor,
    spec: QuantSpec = QuantSpec(),
    *,
    amax: float | torch.Tensor | None = None,
    seed: int | None = None,
    name: str = "input",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """dequantize(quantize(x), dtype or x.dtype): the values a GEMM on NVFP4 operands would see."""
    return dequantize(quantize(x, spec, amax=amax, seed=seed, name=name), dtype or x.dtype)


def check_units_spec(spec: QuantSpec, what: str = "quantize_units") -> None:
    """A stack's quantization (quantize_units, quantize_stack) takes a per-tensor global scale
    and round-to-nearest (each matrix's own amax; no draws, whose order would depend on how the
    stack is split)."""
    if spec.row_scaled or spec.rounding == "stochastic":
        raise ValueError(f"{what} takes a per-tensor, round-to-nearest spec, got {spec}")


def quantize_stack(x: torch.Tensor, spec: QuantSpec, name: str = "input") -> list[NVFP4Tensor]:
    """Each matrix of x [..., M, K] (leading dims flattened) quantized as alone, with its own
    global amax: a stack of expert weights, each its own tensor."""
    check_input(x, spec, name)
    check_units_spec(spec, "quantize_stack")
    if x.dim() < 2:
        raise ValueError(f"{name}: quantize_stack takes matrices, got shape {tuple(x.shape)}")
    return [quantize(m, spec, name=name) for m in x.reshape(-1, *x.shape[-2:])]


def fake_quantize_stack(x: torch.Tensor, spec: QuantSpec, *, name: str = "input",
                        dtype: torch.dtype | None = None) -> torch.Tensor:
    """fake_quantize of each matrix of x [..., M, K] with its own global amax, shaped as x, in
    `dtype` (default x's)."""
    mats = quantize_stack(x, spec, name)
    if not mats:
        return x.to(dtype or x.dtype)
    return torch.stack([dequantize(q, dtype or x.dtype) for q in mats]).reshape(x.shape)


def quantize_units(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Each matrix of x [..., M, K] quantized with its own global amax, as units: the float32
    E2M1 value times its E4M3 block scale (the values divided by the matrix's decode scale D,
    exact), and the amaxes [...] (0-d for a matrix). units * D is fake_quantize's value."""
    check_input(x, spec, "input")
    check_units_spec(spec)
    full_range = 6.0 * spec.scale_max  # its decode scale is exactly 1: 2688 * fl(1/2688) == 1
    mats = x.reshape(-1, *x.shape[-2:])
    units, amaxes = [], []
    for m in mats:
        q = quantize(m, spec)
        amaxes.append(q.amax)
        q = NVFP4Tensor(q.data, q.scales, torch.full_like(q.amax, full_range), q.shape, spec)
        units.append(dequantize(q))
    return (torch.stack(units).reshape(x.shape),
            torch.stack(amaxes).reshape(x.shape[:-2]))
