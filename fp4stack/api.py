"""Public quantize / dequantize / fake_quantize: the one dispatch point between backends.

CUDA tensors go to the Triton kernels when Triton is installed; everything else runs the torch
reference. Both produce the same bits. Set FP4STACK_BACKEND=reference to force the reference.
Under torch.compile each call is one of the custom ops of fp4stack.ops (the same backends), so
a compiled model traces the quantizer as one opaque node; eager calls skip the op dispatch.
"""

from __future__ import annotations

import torch

from . import ops
from .formats import nvfp4 as reference
from .formats.fp8 import fake_quantize_fp8
from .formats.hadamard import rht_inverse
from .formats.random import draw_seed_tensor
from .formats.spec import QuantSpec
from .formats.tensor import NVFP4Tensor
from .ops import backend_for

__all__ = ["backend_for", "check_seed", "dequantize", "fake_quantize", "fake_quantize_stack",
           "global_amax", "make_spec", "quantize", "quantize_stack", "stackable"]


def _impl(device: torch.device):
    return ops.impl(device)


def _check_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")


_DEFAULT_SPEC = QuantSpec()


def check_seed(seed: object) -> None:
    """TypeError unless `seed` is None, an int (not a bool) or an int64 tensor of one element.
    Any int works: it is folded to two 32-bit keys from its low 64 bits (formats/random.py,
    `seed_keys`); a tensor draws what its value would."""
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64 or seed.numel() != 1:
            raise TypeError(f"a seed tensor must be int64 with one element, got {seed.dtype} "
                            f"of shape {tuple(seed.shape)}")
        return
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int (or None: a draw from torch's generator), got "
                        f"{seed!r}")


def _op_seed(spec: QuantSpec, seed) -> torch.Tensor | None:
    # Under torch.compile the draw is a node of the graph (the same draw as eager's), so the op
    # itself keeps no hidden generator state.
    if spec.rounding != "stochastic":
        return None
    return draw_seed_tensor() if seed is None else ops.seed_tensor(seed)


def _op_amax(amax) -> torch.Tensor | None:
    if amax is None or isinstance(amax, torch.Tensor):
        return amax
    return reference.as_amax(amax, torch.device("cpu"))  # a float is checked here, on the host


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
    seed: int | torch.Tensor | None = None,
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
    if torch.compiler.is_compiling():
        reference.check_input(x, spec, name)
        amax = _traced_amax(x, spec, amax)
        data, scales, amax_t = ops.quantize_op(x, ops.spec_key(spec), _op_amax(amax),
                                               _op_seed(spec, seed), name)
        return NVFP4Tensor(data=data, scales=scales.view(torch.float8_e4m3fn), amax=amax_t,
                           shape=x.shape, spec=spec)
    return _impl(x.device).quantize(x, spec, amax=amax, seed=seed, name=name)


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of `t` as `dtype` (float32 maths, one rounding to `dtype` at the end)."""
    if not isinstance(t, NVFP4Tensor):
        raise TypeError(f"dequantize expects an NVFP4Tensor, got {type(t).__name__}")
    if torch.compiler.is_compiling():
        return ops.dequantize_op(t.data, t.scales.view(torch.uint8), t.amax, list(t.shape),
                                 ops.spec_key(t.spec), dtype)
    return _impl(t.device).dequantize(t, dtype)


def global_amax(x: torch.Tensor, *, hadamard: bool = False) -> torch.Tensor:
    """max |x| as a float32 0-d tensor (NaN if x holds one), after the 16-point Hadamard
    transform when `hadamard`: the global amax `quantize` scales by when none is imposed."""
    _check_tensor(x, "x")
    return ops.global_amax_op(x, hadamard)


def fusable_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as float32 (0-d) in torch ops: under torch.compile, Inductor fuses the reduction
    into the kernel that produces x. The value is the amax kernel's: a max is exact in any
    order, abs and the cast to float32 are exact, and NaN propagates as in torch.amax."""
    return x.detach().abs().amax().to(torch.float32)


def imposable_amax(spec: QuantSpec) -> bool:
    """Whether max |x| of the tensor itself, passed as `amax=`, gives `spec`'s own bits: NVFP4
    with one global scale per tensor, no Hadamard transform (its amax is of the transformed
    tensor) and nan_policy "propagate" (an imposed amax skips the check of x)."""
    return (spec.format == "nvfp4" and not spec.hadamard and not spec.row_scaled
            and spec.nan_policy == "propagate")


def fake_quantize_pair(
    x: torch.Tensor, spec: QuantSpec, spec_t: QuantSpec, *,
    amax: torch.Tensor | None = None, amax_t: torch.Tensor | None = None,
    seed: int | torch.Tensor | None = None, seed_t: int | torch.Tensor | None = None,
    cols_t: int | None = None, dtype: torch.dtype | None = None, name: str = "input",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fake_quantize(x, spec=spec)` and `fake_quantize(xᵀ, spec=spec_t)` of a matrix x, both
    NVFP4, with xᵀ zero-padded to `cols_t` columns (default: x's rows; at most to whole
    blocks): a linear's forward operand and its backward's column-wise one. The same bits and
    random draws, in that order, as the two calls; the Triton kernels make both from one read
    of x. No gradient (the linears call it inside their own autograd functions)."""
    _check_tensor(x, name)
    check_seed(seed)
    check_seed(seed_t)
    cols_t = x.shape[0] if cols_t is None else cols_t
    reference.check_pair(x, make_spec(spec), make_spec(spec_t), cols_t, name)
    if torch.compiler.is_compiling():
        amax = _traced_amax(x, spec, amax)
        amax_t = _traced_amax(x, spec_t, amax_t)
        return ops.fake_quantize_pair_op(
            x, ops.spec_key(spec), ops.spec_key(spec_t), _op_amax(amax), _op_amax(amax_t),
            _op_seed(spec, seed), _op_seed(spec_t, seed_t), cols_t, name, dtype)
    return ops.fake_quantize_pair(x, spec, spec_t, amax=amax, amax_t=amax_t, seed=seed,
                                  seed_t=seed_t, cols_t=cols_t, dtype=dtype, name=name)


def quantize_units(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Each matrix of x [..., M, K] quantized by `spec` with its own global amax, as units
    (float32 E2M1 value x E4M3 block scale, exact in TF32 and BF16) and the amaxes [...]: a
    stack of GEMM operands in one pass (Muon4's Newton-Schulz), whose values are units times
    each matrix's decode scale."""
    _check_tensor(x, "x")
    return _impl(x.device).quantize_units(x, spec)


def stackable(spec: QuantSpec) -> bool:
    """Whether quantize_stack and fake_quantize_stack take `spec`: NVFP4 with one global scale
    a matrix, rounded to nearest."""
    return spec.format == "nvfp4" and not spec.row_scaled and spec.rounding == "rne"


def quantize_stack(x: torch.Tensor, spec: QuantSpec, *, name: str = "input"
                   ) -> list[NVFP4Tensor]:
    """Each matrix of x [..., M, K] (leading dims flattened) quantized by `spec` as alone, with
    its own global amax: `[quantize(m, spec=spec) for m in matrices]` bit for bit, in a few
    launches for the whole stack (expert weights). NVFP4, per-tensor scale, round-to-nearest."""
    _check_tensor(x, name)
    return _impl(x.device).quantize_stack(x, spec, name=name)


def fake_quantize_stack(x: torch.Tensor, spec: QuantSpec, *, name: str = "input",
                        dtype: torch.dtype | None = None) -> torch.Tensor:
    """fake_quantize of each matrix of x [..., M, K] with its own global amax, shaped as x, in
    `dtype` (default x's), bit for bit as one matrix at a time; no gradient (a weight stack
    quantized for GEMMs whose backward is written out). As quantize_stack."""
    _check_tensor(x, name)
    return _impl(x.device).fake_quantize_stack(x, spec, name=name, dtype=dtype)


def _traced_amax(x: torch.Tensor, spec: QuantSpec, amax):
    # Under compile, the amax a spec would compute itself, as `fusable_amax` outside the
    # quantizer op, which then launches only its quantize kernel.
    if amax is not None or not imposable_amax(spec) or x.numel() == 0:
        return amax
    return fusable_amax(x)


def _fake_quantize_values(x, spec, amax, seed, name, dtype):
    if torch.compiler.is_compiling():
        if spec.format == "nvfp4":
            reference.check_input(x, spec, name)
            amax = _traced_amax(x, spec, amax)
        return ops.fake_quantize_op(x, ops.spec_key(spec), _op_amax(amax), _op_seed(spec, seed),
                                    name, dtype)
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
    seed: int | torch.Tensor | None = None,
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
