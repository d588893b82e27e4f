"""The quantizer as torch custom ops (namespace "fp4stack"), and the backend each device takes.

torch.compile sees each op as one node with a fake (shape-only) implementation, so a traced
model never looks inside the quantizer: no graph break on its host-side checks, and its shapes
and dtypes are known without running it. The ops take a QuantSpec as its `spec_key` string
(custom-op schemas take tensors, numbers and strings) and a stochastic-rounding seed as an int64
tensor, drawn by the caller, so that the graph holds the draw and the op itself has no hidden
state. Each op runs the backend `backend_for` picks for its tensor: the torch reference on the
CPU (so CI runs every op), the Triton kernels on CUDA; the same bits either way.

    quantize(x, spec, amax?, seed?, name) -> (data, scale bytes, amax)
    fake_quantize(x, spec, amax?, seed?, name, dtype?) -> x_hat
    fake_quantize_pair(x, spec, spec_t, amax?, amax_t?, seed?, seed_t?, cols_t, name, dtype?)
        -> (x_hat, xt_hat)
    dequantize(data, scale bytes, amax, shape, spec, dtype) -> x_hat
    global_amax(x, hadamard) -> amax
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from .formats import nvfp4 as reference
from .formats.fp8 import fake_quantize_fp8
from .formats.hadamard import rht
from .formats.spec import QuantSpec
from .formats.tensor import BLOCK, NVFP4Tensor, amax_shape, padded_k

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


def impl(device: torch.device):
    """The module (kernels or formats.nvfp4) whose quantize / fake_quantize / dequantize run
    tensors on `device`."""
    if backend_for(device) == "triton":
        from . import kernels

        return kernels
    return reference


def spec_key(spec: QuantSpec) -> str:
    """`spec` as the string the ops take (every field, in order); `spec_from_key` inverts it."""
    return (f"{spec.format},{spec.block[0]},{spec.block[1]},{spec.rounding},"
            f"{int(spec.hadamard)},{int(spec.four_over_six)},{spec.nan_policy},"
            f"{spec.global_scale}")


@functools.cache
def spec_from_key(key: str) -> QuantSpec:
    """The QuantSpec of a `spec_key` string (validated by QuantSpec itself)."""
    fmt, b0, b1, rounding, hadamard, four_over_six, nan_policy, global_scale = key.split(",")
    return QuantSpec(format=fmt, block=(int(b0), int(b1)), rounding=rounding,
                     hadamard=hadamard == "1", four_over_six=four_over_six == "1",
                     nan_policy=nan_policy, global_scale=global_scale)


def seed_tensor(seed: int | torch.Tensor | None) -> torch.Tensor | None:
    """A seed as the ops take it: an int64 tensor of one element. An int keeps its low 64 bits,
    all that `seed_keys` reads, so it draws the same values."""
    if seed is None or isinstance(seed, torch.Tensor):
        return seed
    return torch.tensor((seed + 2**63) % 2**64 - 2**63, dtype=torch.int64)


_LIBRARY = torch.library.Library("fp4stack", "FRAGMENT")


def functional_op(name: str, fake: Callable[..., Any]):
    """Decorator: the function as the op fp4stack::<name>, its schema from its type hints (as
    torch.library.custom_op infers it), run for CPU and CUDA tensors, with `fake` as its
    fake-tensor and meta implementation. Returns the op (torch.ops.fp4stack.<name>.default).

    A call goes from the dispatcher straight to the function, without custom_op's Python
    autograd and dispatch wrappers, which cost more host time than the quantizer's own Python
    (benchmarks/op_dispatch_overhead.py); a compiled training step calls the quantizer ops
    thousands of times. The function must
    neither mutate its inputs nor return one of them (see `_fresh`); it has no autograd
    formula (the layers call it inside their own autograd functions)."""

    def define(fn: Callable[..., Any]):
        _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=()))
        for key in ("CPU", "CUDA"):
            _LIBRARY.impl(name, fn, key)
        torch.library.register_fake(f"fp4stack::{name}", fake, lib=_LIBRARY)
        return getattr(torch.ops.fp4stack, name).default

    return define


def _fresh(t: torch.Tensor, like: torch.Tensor | None) -> torch.Tensor:
    # A custom op's output may not alias an input (the imposed amax comes back as it is).
    same = like is not None and t.untyped_storage().data_ptr() == like.untyped_storage().data_ptr()
    return t.clone() if same else t


def _quantize_fake(x, spec, amax, seed, name):
    kp = padded_k(x.shape[-1])
    lead = x.shape[:-1]
    return (x.new_empty((*lead, kp // 2), dtype=torch.uint8),
            x.new_empty((*lead, kp // BLOCK), dtype=torch.uint8),
            x.new_empty(amax_shape(x.shape, spec_from_key(spec)), dtype=torch.float32))


@functional_op("quantize", _quantize_fake)
def quantize_op(x: torch.Tensor, spec: str, amax: torch.Tensor | None, seed: torch.Tensor | None,
                name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 codes [..., Kp/2] uint8, the E4M3 scales' bytes [..., Kp/16] uint8 (bytes, not
    float8: opcheck's comparisons have no float8 kernels on the CPU) and the global amax."""
    t = impl(x.device).quantize(x, spec_from_key(spec), amax=amax, seed=seed, name=name)
    scales = t.scales.view(torch.uint8).contiguous()
    return t.data.contiguous(), scales, _fresh(t.amax, amax)


def _fake_quantize_fake(x, spec, amax, seed, name, dtype):
    return x.new_empty(x.shape, dtype=dtype or x.dtype)


@functional_op("fake_quantize", _fake_quantize_fake)
def fake_quantize_op(x: torch.Tensor, spec: str, amax: torch.Tensor | None,
                     seed: torch.Tensor | None, name: str,
                     dtype: torch.dtype | None) -> torch.Tensor:
    """dequantize(quantize(x)) in `dtype` (default x's); an FP8 spec gives the FP8 baseline's."""
    s = spec_from_key(spec)
    if s.format == "fp8":
        out = fake_quantize_fp8(x, s.fp8_granularity, nan_policy=s.nan_policy, name=name)
        out = out.to(dtype or x.dtype)
    else:
        out = impl(x.device).fake_quantize(x, s, amax=amax, seed=seed, name=name, dtype=dtype)
    return _fresh(out.contiguous(), x)


def fake_quantize_pair(x: torch.Tensor, spec: QuantSpec, spec_t: QuantSpec, *, amax, amax_t,
                       seed, seed_t, cols_t: int, dtype: torch.dtype | None, name: str):
    """fake_quantize of the matrix x by `spec`, and of xᵀ zero-padded to cols_t columns by
    `spec_t`, on x's backend: the Triton kernels read x once where they can."""
    if backend_for(x.device) == "triton":
        from . import kernels

        return kernels.fake_quantize_pair(x, spec, spec_t, amax=amax, amax_t=amax_t, seed=seed,
                                          seed_t=seed_t, cols_t=cols_t, dtype=dtype, name=name)
    xt = torch.nn.functional.pad(x.t(), (0, cols_t - x.shape[0]))
    return (reference.fake_quantize(x, spec, amax=amax, seed=seed, name=name, dtype=dtype),
            reference.fake_quantize(xt, spec_t, amax=amax_t, seed=seed_t, name=name,
                                    dtype=dtype))


def _pair_fake(x, spec, spec_t, amax, amax_t, seed, seed_t, cols_t, name, dtype):
    return (x.new_empty(x.shape, dtype=dtype or x.dtype),
            x.new_empty((x.shape[1], cols_t), dtype=dtype or x.dtype))


@functional_op("fake_quantize_pair", _pair_fake)
def fake_quantize_pair_op(x: torch.Tensor, spec: str, spec_t: str, amax: torch.Tensor | None,
                          amax_t: torch.Tensor | None, seed: torch.Tensor | None,
                          seed_t: torch.Tensor | None, cols_t: int, name: str,
                          dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`fake_quantize_pair` as one node of a compiled graph."""
    out, out_t = fake_quantize_pair(x, spec_from_key(spec), spec_from_key(spec_t), amax=amax,
                                    amax_t=amax_t, seed=seed, seed_t=seed_t, cols_t=cols_t,
                                    dtype=dtype, name=name)
    return _fresh(out.contiguous(), x), _fresh(out_t.contiguous(), x)


def _dequantize_fake(data, scales, amax, shape, spec, dtype):
    return data.new_empty(shape, dtype=dtype)


@functional_op("dequantize", _dequantize_fake)
def dequantize_op(data: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor,
                  shape: list[int], spec: str, dtype: torch.dtype) -> torch.Tensor:
    """The values of the NVFP4 tensor (data, scale bytes, amax) of logical `shape`, in `dtype`."""
    t = NVFP4Tensor(data=data, scales=scales.view(torch.float8_e4m3fn), amax=amax,
                    shape=torch.Size(shape), spec=spec_from_key(spec))
    return impl(data.device).dequantize(t, dtype).contiguous()


def _global_amax_fake(x, hadamard):
    return x.new_empty((), dtype=torch.float32)


@functional_op("global_amax", _global_amax_fake)
def global_amax_op(x: torch.Tensor, hadamard: bool) -> torch.Tensor:
    """max |x| as a float32 0-d tensor (NaN if x holds one), after the 16-point Hadamard
    transform of each row block when `hadamard` (the amax a transformed tensor is scaled by)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    if backend_for(x.device) == "triton":
        from .kernels.nvfp4 import global_amax

        return global_amax(x, hadamard)
    xf = x.detach().to(torch.float32)
    if hadamard:
        xf = rht(xf)
    return xf.abs().amax()
