"""The operand helpers every quantized GEMM path shares (linear layers, experts, inference ops):
an operand's quantized values, the dtype a GEMM multiplies in, and whether the fused inference
kernels may run. Kept apart from nn.linear so the paths that use them import no layer."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..api import (
    backend_for,
    fake_quantize,
    fake_quantize_pair,
    fusable_amax,
    global_amax,
    imposable_amax,
)
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
    if not transposes_in_place():  # copied here, where Inductor can fuse it into t's producer
        tt = tt.contiguous()
    return fake_quantize(tt, spec=spec, amax=amax, dtype=dtype, seed=seed).t()


def transposes_in_place() -> bool:
    """Whether the Triton kernels read a transposed operand in place and make an operand with
    its column-wise copy in one kernel (`kernels.nvfp4.TRANSPOSE_IN_KERNEL`). Otherwise the
    column-wise operands are transposed copies quantized row by row, the copy made in the
    caller's graph, so that a compiled step can fuse it into the tensor's producer."""
    if not kernels.available():
        return False
    from ..kernels import nvfp4

    return nvfp4.TRANSPOSE_IN_KERNEL


def quantize_operand_pair(t: torch.Tensor, spec: QuantSpec | None, spec_t: QuantSpec | None,
                          amax=None, amax_t=None, dtype: torch.dtype | None = None,
                          seed=None, seed_t=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantize_operand(t, spec, amax, seed=seed), quantize_operand(t, spec_t, amax_t,
    columnwise=True, seed=seed_t)), both in `dtype`: the same values and random draws, in that
    order, with both made from one read of the matrix t where both specs are NVFP4 and the
    kernels read transposes in place (`api.fake_quantize_pair`, `transposes_in_place`)."""
    if (t.dim() != 2 or spec is None or spec_t is None or spec.format != "nvfp4"
            or spec_t.format != "nvfp4" or not transposes_in_place()):
        return (quantize_operand(t, spec, amax, dtype=dtype, seed=seed),
                quantize_operand(t, spec_t, amax_t, columnwise=True, dtype=dtype, seed=seed_t))
    cols_t = t.shape[0] + (-t.shape[0] % _BLOCK if spec_t.hadamard else 0)
    q, q_t = fake_quantize_pair(t, spec, spec_t, amax=amax, amax_t=amax_t, seed=seed,
                                seed_t=seed_t, cols_t=cols_t, dtype=dtype)
    return q, q_t.t()


def common_amax(t: torch.Tensor, *specs: QuantSpec | None) -> torch.Tensor | None:
    """max |t| (float32, 0-d) when every spec in `specs` would compute exactly that global amax
    of t, row-wise or column-wise alike (`api.imposable_amax`); else None. One amax pass then
    serves the forward operand and its column-wise copy for the backward, with the same bits
    as two."""
    if not all(s is not None and imposable_amax(s) for s in specs):
        return None
    return fusable_amax(t) if torch.compiler.is_compiling() and t.numel() else global_amax(t)


# The step's weight operands while `weight_operands_once` is active: (parameter id, its version,
# spec, columnwise, dtype, whether an amax is imposed) -> (parameter, quantized operand).
_STEP_WEIGHTS: dict | None = None


@contextmanager
def weight_operands_once() -> Iterator[None]:
    """Inside, each parameter's quantized weight operands (the forward's Q(W) and the backward's
    column-wise one) are computed once and reused by later forwards, as the micro-batches of one
    optimizer step read the same weights: fewer quantize and amax passes, the same bits. Only
    round-to-nearest specs are reused (a stochastic rounding draws fresh values per call, so the
    random stream stays as without the cache); an in-place change of a parameter (its version
    counter) computes it again; torch.compile's traced code does not use it. The caller
    promises that nothing else the weight operands depend on (an imposed amax, a layer's
    buffers) changes inside. Nested uses share the outer cache; it is dropped on exit."""
    global _STEP_WEIGHTS
    outer = _STEP_WEIGHTS
    _STEP_WEIGHTS = {} if outer is None else outer
    try:
        yield
    finally:
        _STEP_WEIGHTS = outer


def step_operand(w: torch.Tensor, key: tuple, make):
    """make(), an operand computed from the parameter w alone (`key` says how), reused inside
    `weight_operands_once` for the same w, unchanged (its version counter), and key. Only
    parameters are cached: an activation's id would not say it is the same tensor."""
    cache = _STEP_WEIGHTS
    if cache is None or not isinstance(w, nn.Parameter) or torch.compiler.is_compiling():
        return make()
    full = (id(w), w._version, key)
    hit = cache.get(full)
    if hit is None:  # w is kept with its operand: its id cannot be reused meanwhile
        hit = cache[full] = (w, make())
    return hit[1]


def weight_operand(w: torch.Tensor, spec: QuantSpec | None, amax=None, columnwise: bool = False,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """quantize_operand of a weight, reused inside `weight_operands_once` (see there)."""
    def make():
        return quantize_operand(w, spec, amax, columnwise=columnwise, dtype=dtype)

    if spec is None or spec.rounding == "stochastic":
        return make()
    return step_operand(w, (spec, columnwise, dtype, amax is None), make)


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
