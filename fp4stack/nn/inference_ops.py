"""The packed inference GEMMs as torch custom ops: a QuantLinear's packed GEMM and the grouped
MoE experts, so torch.compile sees each as one node (its fake implementation gives the shape)
instead of tracing into Triton launches.

    fp4stack::packed_linear(a, data, scale bytes, amax, k, spec, bias?, segments)
        -> a @ Wᵀ (+ bias)
    fp4stack::grouped_mlp(x, weights, indices, gate_up, down, ks, w_spec, x_spec, dtype,
                          comp_counts, comp_norms) -> float32 [T, D]

Each runs the Triton kernels (kernels.packed_gemm.packed_linear, kernels.moe_align.grouped_mlp)
where `kernels_run` says so: CUDA tensors with the Triton backend, or CPU tensors under the
Triton interpreter when the tests force the fused paths (nn.operands._FUSED_ON_CPU). Elsewhere a
torch reference with the callers' numerics: the weight dequantized to the GEMM dtype and
multiplied (the bias rounded to that dtype and added), and the experts one by one, each
expert's activations quantized with the amax of the rows it receives (and, with QUADS's
compensation, its channels of highest residual energy put back to x's values).
Weights cross the op boundary as their parts (codes, scale bytes, amax; custom-op schemas take
tensors, not NVFP4Tensor) and their QuantSpec as `ops.spec_key` strings. As api.py does for the
quantizer, the functions `packed_linear` and `grouped_mlp` skip the op dispatch in eager mode
(the same code runs) and call the ops under torch.compile.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from ..api import dequantize, fake_quantize
from ..formats.fp8 import fake_quantize_fp8
from ..formats.spec import QuantSpec
from ..formats.tensor import NVFP4Tensor
from ..ops import backend_for, spec_from_key, spec_key
from .compensation import energy_with_norms, top_indices
from .grouped_experts import _rows, combine, sort_pairs


def kernels_run(x: Tensor) -> bool:
    """Whether the ops run their Triton kernels on x (see the module docstring)."""
    if x.is_cuda:
        return backend_for(x.device) == "triton"
    from .. import kernels
    from . import operands

    return operands._FUSED_ON_CPU and kernels.available()


def _weight(data: Tensor, scales: Tensor, amax: Tensor, k: int, spec: QuantSpec) -> NVFP4Tensor:
    return NVFP4Tensor(data, scales.view(torch.float8_e4m3fn), amax,
                       torch.Size((*data.shape[:-1], k)), spec)


def packed_linear(a: Tensor, w: NVFP4Tensor, bias: Tensor | None = None,
                  segments: tuple[int, ...] = ()) -> Tensor:
    """y [M, N] = a @ Wᵀ (+ bias) in a's dtype for a [M, K] and a packed NVFP4 weight W [N, K]
    (1x16 blocks or 16x16 tiles); with `segments` (sibling row counts) a is [J, M, K], one
    operand per sibling (kernels.packed_gemm.packed_linear). The op `packed_linear_op` under
    torch.compile."""
    if torch.compiler.is_compiling():
        return packed_linear_op(a, w.data, w.scales.view(torch.uint8), w.amax, w.shape[-1],
                                spec_key(w.spec), bias, list(segments))
    if kernels_run(a):
        from ..kernels.packed_gemm import packed_linear as kernel

        return kernel(a, w, bias, segments=tuple(segments))
    wd = dequantize(w, a.dtype)
    if segments:
        y = torch.cat([a[j] @ part.t() for j, part in enumerate(wd.split(list(segments)))], 1)
    else:
        y = a @ wd.t()
    return y if bias is None else y + bias.to(a.dtype)


@torch.library.custom_op("fp4stack::packed_linear", mutates_args=())
def packed_linear_op(a: Tensor, data: Tensor, scales: Tensor, amax: Tensor, k: int, spec: str,
                     bias: Tensor | None, segments: list[int]) -> Tensor:
    """`packed_linear` of the weight [N, k] given by its codes [N, kp/2], E4M3 scale bytes
    [N, kp/16] uint8, global amax and spec key; segments [] or the siblings' row counts."""
    return packed_linear(a, _weight(data, scales, amax, k, spec_from_key(spec)), bias,
                         tuple(segments))


@packed_linear_op.register_fake
def _(a, data, scales, amax, k, spec, bias, segments):
    return a.new_empty((a.shape[-2], data.shape[0]))


@dataclass(frozen=True)
class PackedStack:
    """A stack of E packed NVFP4 weights [E, N, k], one amax each: the fields of
    kernels.packed_gemm.PackedExperts (which needs Triton to import)."""

    data: Tensor
    scales: Tensor
    amax: Tensor
    k: int
    spec: QuantSpec

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data.shape[0], self.data.shape[1], self.k)


def _expert_weight(w, e: int, dtype: torch.dtype) -> Tensor:
    # Expert e's weight in dtype: a plain stack's entry, or a packed stack's dequantized.
    if isinstance(w, Tensor):
        return w[e].to(dtype)
    return dequantize(_weight(w.data[e], w.scales[e].view(torch.uint8), w.amax[e], w.k, w.spec),
                      dtype)


def _activations(x: Tensor, spec: QuantSpec | None, dtype: torch.dtype,
                 compensation: tuple[int, Tensor] | None = None) -> Tensor:
    # One expert's input rows as its GEMM operand: NVFP4 with those rows' own amax, or FP8;
    # with compensation (count, that expert's column norms or static keep mask), x~ of
    # nn.compensation.
    if spec is None or spec.format == "none":
        return x.to(dtype)
    spec = replace(spec, nan_policy="propagate")  # no host check, as the kernels
    if spec.format == "fp8":
        return fake_quantize_fp8(x, spec.fp8_granularity, nan_policy="propagate").to(dtype)
    if compensation is None:
        return fake_quantize(x, spec=spec, dtype=dtype)
    count, per_channel = compensation
    q = fake_quantize(x, spec=spec)
    if per_channel.dtype == torch.bool:  # static channels: that expert's keep mask
        return torch.where(per_channel, x, q).to(dtype)
    energy = energy_with_norms((x - q).float(), per_channel)
    channels = top_indices(energy, count)
    return q.index_copy(1, channels, x[:, channels]).to(dtype)


def grouped_mlp(x: Tensor, weights: Tensor, indices: Tensor, gate_up, down,
                x_spec: QuantSpec | None = None, dtype: torch.dtype | None = None,
                compensation=None) -> Tensor:
    """float32 [T, D]: the SwiGLU experts of x [T, D] routed by weights / indices [T, k], as
    kernels.moe_align.grouped_mlp computes them: gate_up [E, 2I, D] and down [E, D, I] both
    packed stacks (PackedExperts, PackedStack) or both plain tensors, x_spec the activations'
    spec (None: unquantized), GEMMs in `dtype` (default x's); `compensation` None or per
    projection (channel count, column norms [E, K] of its packed weights): QUADS; the op
    `grouped_mlp_op` under torch.compile."""
    dtype = dtype or x.dtype
    if torch.compiler.is_compiling():
        def parts(w):
            if isinstance(w, Tensor):
                return [w], w.shape[-1], ""
            return [w.data, w.scales.view(torch.uint8), w.amax], w.k, spec_key(w.spec)

        (gu, k_gu, w_spec), (dn, k_dn, _) = parts(gate_up), parts(down)
        xs = "" if x_spec is None or x_spec.format == "none" else spec_key(x_spec)
        counts, norms = ([], []) if compensation is None else (
            [count for count, _ in compensation], [norms for _, norms in compensation])
        return grouped_mlp_op(x, weights, indices, gu, dn, [k_gu, k_dn], w_spec, xs, dtype,
                              counts, norms)
    if kernels_run(x):
        from ..kernels.moe_align import grouped_mlp as kernel
        from ..kernels.packed_gemm import PackedExperts

        def kernel_stack(w):
            return w if isinstance(w, Tensor | PackedExperts) else PackedExperts(
                w.data, w.scales, w.amax, w.k, w.spec)

        return kernel(x, weights, indices, kernel_stack(gate_up), kernel_stack(down), x_spec,
                      dtype, compensation)
    n_experts, top_k = gate_up.shape[0], indices.shape[1]
    order, counts = sort_pairs(indices, n_experts)
    xs = x[order // top_k]
    y = torch.zeros((xs.shape[0], down.shape[1]), dtype=dtype, device=x.device)
    comp_gu = comp_dn = None
    for e, rows in _rows(counts):
        if compensation is not None:  # expert e's count and column norms, per projection
            comp_gu, comp_dn = ((count, norms[e]) for count, norms in compensation)
        gate, up = (_activations(xs[rows], x_spec, dtype, comp_gu)
                    @ _expert_weight(gate_up, e, dtype).t()).chunk(2, dim=-1)
        h = _activations(F.silu(gate) * up, x_spec, dtype, comp_dn)
        y[rows] = h @ _expert_weight(down, e, dtype).t()
    return combine(y, weights, order, top_k).float()


@torch.library.custom_op("fp4stack::grouped_mlp", mutates_args=())
def grouped_mlp_op(x: Tensor, weights: Tensor, indices: Tensor, gate_up: list[Tensor],
                   down: list[Tensor], ks: list[int], w_spec: str, x_spec: str,
                   dtype: torch.dtype, comp_counts: list[int],
                   comp_norms: list[Tensor]) -> Tensor:
    """`grouped_mlp` with gate_up / down as [data, scale bytes, amax] of packed stacks (w_spec
    their spec key) or [stack] of plain ones (w_spec ""), ks their K, x_spec a spec key ("":
    unquantized), comp_counts / comp_norms the compensation's per projection (empty: none)."""
    def stack(parts, k):
        if not w_spec:
            return parts[0]
        data, scales, amax = parts
        return PackedStack(data, scales.view(torch.float8_e4m3fn), amax, k,
                           spec_from_key(w_spec))

    spec = spec_from_key(x_spec) if x_spec else None
    compensation = tuple(zip(comp_counts, comp_norms, strict=True)) or None
    return grouped_mlp(x, weights, indices, stack(gate_up, ks[0]), stack(down, ks[1]), spec,
                       dtype, compensation)


@grouped_mlp_op.register_fake
def _(x, weights, indices, gate_up, down, ks, w_spec, x_spec, dtype, comp_counts, comp_norms):
    return x.new_empty(x.shape, dtype=torch.float32)
