"""Public quantize / dequantize / fake_quantize: the one dispatch point between backends.

CUDA tensors go to the Triton kernels when Triton is installed; everything else runs the torch
reference. Both produce the same bits. Set FP4STACK_BACKEND=reference to force the reference.
"""

from __future__ import annotations

import os

import torch

from .formats import nvfp4 as reference
from .formats.fp8 import fake_quantize_fp8
from .formats.hadamard import rht_inverse
from .formats.spec import QuantSpec
from .formats.tensor import NVFP4Tensor

_BACKENDS = ("auto", "reference", "triton")


def backend_for(device: torch.device) -> str:
    """'triton' or 'reference': the backend a tensor on `device` is quantized with."""
    choice = os.environ.get("FP4STACK_BACKEND", "auto")
    if choice not in _BACKENDS:
        raise ValueError(f"FP4STACK_BACKEND must be one of {_BACKENDS}, got {choice!r}")
    if choice == "reference":
        return "reference"
    from . import kernels

    if device.type == "cuda" and kernels.available():
        return "triton"
    if choice == "triton":
        raise RuntimeError(
            f"FP4STACK_BACKEND=triton but the tensor is on {device} or Triton is missing: "
            "the Triton backend runs CUDA tensors (install fp4stack[gpu])"
        )
    return "reference"


def _impl(device: torch.device):
    if backend_for(device) == "triton":
        from . import kernels

        return kernels
    return reference


def _check_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")


_DEFAULT_SPEC = QuantSpec()


def check_seed(seed: object) -> None:
    """TypeError unless `seed` is None or an int (not a bool). Any int works: it is folded to
    two 32-bit keys from its low 64 bits (formats/random.py, `seed_keys`)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int (or None: a draw from torch's generator), got "
                        f"{seed!r}")


def make_spec(spec: QuantSpec | None, **options) -> QuantSpec:
    """`spec` if given (then no other option may be set), else a QuantSpec from `options`."""
    if spec is None:
        return QuantSpec(**options)
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"spec must be a QuantSpec, got {type(spec).__name__}; build one with "
                        "fp4stack.QuantSpec(**fields) or pass the options themselves")
    # Compared field by field: building a QuantSpec to compare costs more than the quantizer's
    # own host code, and the layers call this with spec= for every operand.
    for key, value in options.items():
        default = getattr(_DEFAULT_SPEC, key)
        if (tuple(value) if key == "block" else value) != default:
            raise ValueError(
                f"pass either spec= or the individual options (block=, rounding=, ...), not "
                f"both: got spec= and {key}={value!r}"
            )
    return spec


def quantize(
    x: torch.Tensor,
    *,
    block: tuple[int, int] = (1, 16),
    rounding: str = "rne",
    hadamard: bool = False,
    four_over_six: bool = False,
    amax: float | torch.Tensor | None = None,
    seed: int | None = None,
    nan_policy: str = "raise",
    columnwise: bool = False,
    spec: QuantSpec | None = None,
    name: str = "input",
) -> NVFP4Tensor:
    """Quantize `x` to NVFP4 along its last dim.

    Args:
        block: (1, 16) blocks, or (16, 16) tiles (for 2D weights: W and Wᵀ quantize identically).
        rounding: "rne", or "stochastic" (unbiased; reproducible from `seed`, which defaults to a
            draw from torch's CPU generator).
        hadamard: apply the 16-point random Hadamard transform first (the result stays in the
            transformed domain; `rht_inverse` maps it back).
        four_over_six: per block, also try mapping the max to 4 and keep the lower-MSE choice.
        amax: impose the global amax (e.g. shared by fused q/k/v); default max |x|.
        nan_policy: "raise" (ValueError on NaN/Inf) or "propagate" (no check, no host sync).
        columnwise: quantize xᵀ (last two dims swapped) instead, for backward GEMMs.
        spec: a QuantSpec instead of the individual options above.
        name: how error messages refer to `x`.
    """
    _check_tensor(x, name)
    check_seed(seed)
    spec = make_spec(
        spec, block=block, rounding=rounding, hadamard=hadamard,
        four_over_six=four_over_six, nan_policy=nan_policy,
    )
    if columnwise:
        if x.dim() < 2:
            raise ValueError(f"{name}: columnwise=True needs >= 2 dims, got {tuple(x.shape)}")
        x = x.transpose(-2, -1)
    return _impl(x.device).quantize(x, spec, amax=amax, seed=seed, name=name)


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of `t` as `dtype` (float32 maths, one rounding to `dtype` at the end)."""
    if not isinstance(t, NVFP4Tensor):
        raise TypeError(f"dequantize expects an NVFP4Tensor, got {type(t).__name__}")
    return _impl(t.device).dequantize(t, dtype)


def _fake_quantize_values(x, spec, amax, seed, name, dtype):
    if spec.format == "fp8":
        return fake_quantize_fp8(x, spec.fp8_granularity, nan_policy=spec.nan_policy,
                                 name=name).to(dtype or x.dtype)
    return _impl(x.device).fake_quantize(x, spec, amax=amax, seed=seed, name=name, dtype=dtype)


class _FakeQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spec, amax, seed, name, dtype):
        ctx.hadamard, ctx.input_dtype = spec.hadamard, x.dtype
        return _fake_quantize_values(x, spec, amax, seed, name, dtype)

    @staticmethod
    def backward(ctx, grad):
        # Straight-through: the quantizer counts as identity; a Hadamard transform does not.
        if ctx.hadamard:
            grad = rht_inverse(grad)
        return grad.to(ctx.input_dtype), None, None, None, None, None


def fake_quantize(
    x: torch.Tensor,
    *,
    block: tuple[int, int] = (1, 16),
    rounding: str = "rne",
    hadamard: bool = False,
    four_over_six: bool = False,
    amax: float | torch.Tensor | None = None,
    seed: int | None = None,
    nan_policy: str = "raise",
    spec: QuantSpec | None = None,
    name: str = "input",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`dequantize(quantize(x, ...), dtype)` bit for bit, with a straight-through gradient.

    `dtype` defaults to x's; another one (an fp32 master weight quantized for a bf16 GEMM) is
    the same as casting the result, one rounding of the float32 values, without the extra pass.
    A `spec` of format "fp8" gives the FP8 baseline's values; "none" returns `x` (cast to dtype).
    """
    _check_tensor(x, name)
    check_seed(seed)
    spec = make_spec(
        spec, block=block, rounding=rounding, hadamard=hadamard,
        four_over_six=four_over_six, nan_policy=nan_policy,
    )
    if spec.format == "none":
        return x if dtype is None else x.to(dtype)
    if not (x.requires_grad and torch.is_grad_enabled()):
        # No graph to record (the linears quantize inside their own autograd function):
        # skipping Function.apply saves its host time on every operand.
        return _fake_quantize_values(x, spec, amax, seed, name, dtype)
    return _FakeQuantize.apply(x, spec, amax, seed, name, dtype)
