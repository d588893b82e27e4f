"""The operand helpers every quantized GEMM path shares (linear layers, experts, inference ops):
an operand's quantized values, the dtype a GEMM multiplies in, and whether the fused inference
kernels may run. Kept apart from nn.linear so the paths that use them import no layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..api import backend_for, fake_quantize
from ..formats.spec import QuantSpec

_BLOCK = 16
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Tests set this to run the fused inference kernels on CPU tensors (under the Triton
# interpreter); CUDA tensors take them whenever `fused_inference_ok` holds.
_FUSED_ON_CPU = False


def quantize_operand(t: torch.Tensor, spec: QuantSpec | None, amax=None,
                     columnwise: bool = False, dtype: torch.dtype | None = None,
                     seed: int | torch.Tensor | None = None) -> torch.Tensor:
    """`t`'s values after quantization by `spec` along its last dim, in `dtype` (default t's);
    `seed` for stochastic rounding (None: a draw from torch's generator).

    columnwise=True quantizes along dim 0 instead (for backward GEMMs) and returns [T', C] with
    the token dim zero-padded to whole blocks when the spec uses the Hadamard transform (zeros add
    nothing to a product; the transformed domain is kept, as both wgrad operands carry it).
    """
    if spec is None or spec.format == "none":
        return t if dtype is None else t.to(dtype)
    if not columnwise:
        return fake_quantize(t, spec=spec, amax=amax, dtype=dtype, seed=seed)
    tt = t.t()
    pad = -tt.shape[-1] % _BLOCK if spec.hadamard else 0
    if pad:
        tt = F.pad(tt, (0, pad))
    return fake_quantize(tt.contiguous(), spec=spec, amax=amax, dtype=dtype, seed=seed).t()


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # The dtype F.linear would multiply in: autocast's when it is on (custom autograd functions
    # are not autocast, and the backward runs outside the autocast region), else x's.
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype



def fused_inference_ok(x: torch.Tensor, module: nn.Module, *tensors: torch.Tensor) -> bool:
    """Whether `module` may run its fused inference kernels on x: Triton is the backend for x's
    device (CUDA; FP4STACK_BACKEND=reference turns them off), x is float32, bf16 or fp16, and
    no gradient is wanted (grad mode off, or neither x, `tensors` nor a parameter needs one)."""
    if x.dtype not in _FUSED_DTYPES or not kernels.available():
        return False
    if not (x.is_cuda and backend_for(x.device) == "triton") and not (
            _FUSED_ON_CPU and not x.is_cuda):
        return False
    if not torch.is_grad_enabled():
        return True
    return not any(t.requires_grad for t in (x, *tensors, *module.parameters()))
