"""W8A8 on FP8 tensor cores: the `w8a8` recipe's GEMM with 1x128 block scales, not emulated.

The FP8 baseline (formats/fp8.py, granularity "block128") gives activations and weights one
float32 scale per 128 elements along K. Hopper multiplies E4M3 operands natively, and
`torch.nn.functional.scaled_mm` with BlockWise1x128 scales on both operands runs that GEMM in
cuBLAS: fp32 accumulation, each 128-wide slice of the dot product times its two scales. The
emulated GEMM (dequantize each operand to BF16, multiply in BF16) rounds every dequantized value
to BF16 first; the native one does not, so the two differ by that rounding (tests bound it).
Where scaled_mm or its block scaling is missing (CPU, older torch), `fp8_linear` emulates.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..formats.fp8 import FP8_BLOCK, FP8Tensor, dequantize_fp8, quantize_fp8


def _column_major(scale: torch.Tensor) -> torch.Tensor:
    # cuBLAS reads block scales outer-dim-major: strides (1, rows).
    return scale.t().contiguous().t()


@functools.cache
def native_block_fp8(device_index: int) -> bool:
    """Whether this torch runs 1x128 x 1x128 block-scaled FP8 GEMMs on this CUDA device."""
    try:
        from torch.nn.functional import ScalingType
    except ImportError:
        return False
    dev = torch.device("cuda", device_index)
    a = torch.zeros(16, FP8_BLOCK, device=dev, dtype=torch.float8_e4m3fn)
    s = _column_major(torch.ones(16, 1, device=dev))
    try:
        F.scaled_mm(a, a.t(), s, ScalingType.BlockWise1x128, s, ScalingType.BlockWise1x128,
                    output_dtype=torch.bfloat16)
    except (RuntimeError, ValueError, NotImplementedError):
        return False
    return True


@torch.no_grad()
def fp8_weight(w: torch.Tensor) -> FP8Tensor:
    """A weight [N, K] as FP8 with 1x128 block scales along K, its scales laid out for
    `fp8_linear` (column-major), so a cached weight costs no copy per call."""
    q = quantize_fp8(w, "block128", nan_policy="propagate", name="weight")
    return FP8Tensor(q.data, _column_major(q.scale), q.shape, q.granularity)


def fp8_linear(x2: torch.Tensor, w: FP8Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = Q8(x2) Q8(W)ᵀ (+ bias) in x2's dtype, x2 [M, K] quantized here with 1x128
    blocks (no host sync: NaN propagates). A native FP8 GEMM for BF16 inputs on CUDA where
    torch has one; elsewhere the emulated GEMM, dequantized operands multiplied in x2's dtype."""
    xq = quantize_fp8(x2, "block128", nan_policy="propagate", name="activation")
    if x2.is_cuda and x2.dtype == torch.bfloat16 and native_block_fp8(x2.device.index or 0):
        from torch.nn.functional import ScalingType

        m = x2.shape[0]
        data, scale = xq.data, xq.scale
        if m % 16:  # cuBLAS wants whole 16-row tiles: pad with zero rows, dropped below
            data = F.pad(data.view(torch.uint8), (0, 0, 0, -m % 16)).view(data.dtype)
            scale = F.pad(scale, (0, 0, 0, -m % 16), value=1.0)
        y = F.scaled_mm(data, w.data.t(), _column_major(scale), ScalingType.BlockWise1x128,
                        w.scale, ScalingType.BlockWise1x128, output_dtype=torch.bfloat16)[:m]
    else:
        y = dequantize_fp8(xq, x2.dtype) @ dequantize_fp8(w, x2.dtype).t()
    return y + bias.to(y.dtype) if bias is not None else y
