"""FP8 E4M3 baselines: per-tensor, per-row and 1x128-block scaling (for comparisons).

scale = amax / 448 (1 where amax == 0), data = e4m3_rne(clamp(x / scale, -448, 448)),
x_hat = data * scale. All maths in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

E4M3_MAX = 448.0
Granularity = Literal["tensor", "row", "block128"]
_GRANULARITIES = ("tensor", "row", "block128")
FP8_BLOCK = 128
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class FP8Tensor:
    """data: float8_e4m3fn [..., K] (K padded to 128 for block128); scale: float32 decode scales
    (0-d, [..., 1] or [..., ceil(K/128)]); shape: logical shape."""

    data: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size
    granularity: Granularity

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(self, dtype)


def _amax_blocks(xf: torch.Tensor, granularity: str) -> torch.Tensor:
    a = xf.abs()
    if granularity == "tensor":
        return a.amax() if a.numel() else torch.zeros((), device=a.device)
    if granularity == "row":
        return a.amax(dim=-1, keepdim=True) if a.shape[-1] else a.new_zeros(*a.shape[:-1], 1)
    return a.reshape(*a.shape[:-1], a.shape[-1] // FP8_BLOCK, FP8_BLOCK).amax(dim=-1)


def _expand(scale: torch.Tensor, granularity: str) -> torch.Tensor:
    if granularity == "block128":
        return scale.repeat_interleave(FP8_BLOCK, dim=-1)
    return scale


def _check(x: torch.Tensor, nan_policy: str, name: str) -> None:
    # The NVFP4 quantizer's rules: float input only, and NaN or Inf raises unless propagated.
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: FP8 quantizes float32, bfloat16 or float16, got {x.dtype}")
    if nan_policy not in ("raise", "propagate"):
        raise ValueError(f"nan_policy must be 'raise' or 'propagate', got {nan_policy!r}")
    if nan_policy == "raise":
        bad = int((~torch.isfinite(x)).sum().item())
        if bad:
            raise ValueError(
                f"{name}: {bad} of {x.numel()} values are NaN or Inf; the FP8 baseline refuses "
                "them as NVFP4 does. Fix the producer of this tensor, or pass "
                "nan_policy='propagate' to quantize anyway")


def quantize_fp8(x: torch.Tensor, granularity: Granularity = "tensor", *,
                 nan_policy: str = "raise", name: str = "input") -> FP8Tensor:
    """Quantize `x` to FP8 E4M3 with float32 decode scales of the given granularity.
    nan_policy: "raise" (ValueError on NaN/Inf, a host sync) or "propagate" (no check)."""
    _check(x, nan_policy, name)
    if granularity not in _GRANULARITIES:
        raise ValueError(f"granularity must be one of {_GRANULARITIES}, got {granularity!r}")
    if x.dim() < 1:
        raise ValueError("quantize_fp8 needs at least one dim")
    k = x.shape[-1]
    xf = x.detach().to(torch.float32)
    if granularity == "block128":
        xf = torch.nn.functional.pad(xf, (0, -k % FP8_BLOCK))
    amax = _amax_blocks(xf, granularity)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / E4M3_MAX)
    q = torch.clamp(xf / _expand(scale, granularity), -E4M3_MAX, E4M3_MAX)
    return FP8Tensor(q.to(torch.float8_e4m3fn), scale, x.shape, granularity)


def dequantize_fp8(t: FP8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = t.data.to(torch.float32) * _expand(t.scale, t.granularity)
    return x[..., : t.shape[-1]].to(dtype)


def fake_quantize_fp8(x: torch.Tensor, granularity: Granularity = "tensor", *,
                      nan_policy: str = "raise", name: str = "input") -> torch.Tensor:
    """`dequantize_fp8(quantize_fp8(x, ...), x.dtype)`."""
    return dequantize_fp8(quantize_fp8(x, granularity, nan_policy=nan_policy, name=name), x.dtype)
