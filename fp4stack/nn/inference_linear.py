"""A QuantLinear's inference without gradients on CUDA: the packed weight's fused GEMM, QUADS's
compensated operand, the native FP8 GEMM; the layer's forward picks them (`nn.linear`).

Every path computes the values of the layer's reference forward; only summation orders differ
(one GEMM of x~ instead of Q(x)'s GEMM plus the correction's, a wider GEMM for fused siblings).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..formats.spec import QuantSpec
from ..formats.tensor import NVFP4Tensor
from .compensation import energy_with_norms
from .operands import _compute_dtype, fused_inference_ok, quantize_operand
from .recipe import Recipe

# The layers here are nn.linear.QuantLinear (not imported: that module imports this one).

def native_fp8_ok(x: torch.Tensor, layer: nn.Module) -> bool:
    """Whether `layer` runs its w8a8 GEMM natively (kernels.fp8_gemm): both operands FP8 with
    1x128 blocks, a master weight, BF16 inputs on CUDA, nothing else in the recipe, no grad."""
    r = layer.recipe
    fp8 = [s is not None and s.format == "fp8" and s.fp8_granularity == "block128"
           for s in (r.x, r.w)]
    return (all(fp8) and layer.weight is not None and x.dtype == torch.bfloat16 and x.is_cuda
            and layer._calibration is None and r.lowrank is None and r.compensation is None
            and fused_inference_ok(x, layer))


def _propagating(spec: QuantSpec) -> QuantSpec:
    """`spec` with nan_policy="propagate": an inference path's NaN check would read the device
    back (a NaN reaches the outputs instead)."""
    if spec.format != "none" and spec.nan_policy != "propagate":
        return replace(spec, nan_policy="propagate")
    return spec


def packed_inference_linear(x2: torch.Tensor, recipe: Recipe, weight: NVFP4Tensor,
                            bias: torch.Tensor | None = None,
                            x_amax: torch.Tensor | None = None) -> torch.Tensor:
    """y = Q(x2) weightᵀ + b, `weight` packed, by the fused kernel: the compensation-free case
    of `quantized_inference_linear`, for any packed weight (one layer's, or siblings' rows side
    by side, nn.fused_projections); the GEMM is the custom op `inference_ops.packed_linear`."""
    from .inference_ops import packed_linear

    a = quantize_operand(x2, _propagating(recipe.x), x_amax, dtype=_compute_dtype(x2))
    return packed_linear(a, weight, bias)


def compensated_siblings_linear(x2: torch.Tensor, layers, weight: NVFP4Tensor,
                                sizes: tuple[int, ...]) -> torch.Tensor:
    """[x2 ~W_jᵀ for each sibling j] side by side: packed layers of one recipe with residual
    compensation whose weights are the row slices `sizes` of `weight`; one Q(x2), an x~ per
    member (its own channels: by its column norms, or its calibrated static ones), one GEMM
    (nn.fused_projections)."""
    from ..kernels.compensation import compensated_operand
    from .inference_ops import packed_linear

    recipe, k = layers[0].recipe, x2.shape[-1]
    keep = norms = None
    if recipe.compensation.mode == "static" and all(m.rc_channels is not None for m in layers):
        keep = torch.stack([m.compensation_keep("rc_channels", k) for m in layers])
    else:  # dynamic, or static before calibration
        norms = torch.stack([m.qweight_column_sq_norms(x2.dtype) for m in layers])
    a = compensated_operand(x2, _propagating(recipe.x), recipe.compensation.count(k), norms,
                            keep=keep)
    return packed_linear(a.to(_compute_dtype(x2)), weight, None, sizes)


def quantized_inference_linear(x2: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """y = Q(x2) Q(W)ᵀ + b for a packed layer, as one fused kernel reading the packed weight
    (`kernels.packed_gemm.packed_linear`, as the custom op `inference_ops.packed_linear`), with
    the layer's recipe and no host sync.

    Q(x) is the recipe's x spec with nan_policy="propagate" (a NaN reaches the outputs), with the
    layer's calibrated x_amax when the recipe's activation amax is static. Residual compensation
    (QUADS) is the same single GEMM: Q(x)Q(W)ᵀ + (x - Q(x))[:, C] Q(W)[:, C]ᵀ = x~ Q(W)ᵀ, x~ being
    Q(x) with the columns C put back to x's own; C is rc_channels (static mode, calibrated) or
    the top channels by residual energy, picked on the device.
    """
    from .inference_ops import packed_linear

    recipe = layer.recipe
    x_amax = layer.x_amax if recipe.activation_amax == "static" else None
    cfg = recipe.compensation
    if cfg is None:
        return packed_inference_linear(x2, recipe, layer.packed_weight, layer.bias, x_amax)
    # As _compensated: Q(x) and the residual in x's dtype, the GEMM in the compute dtype.
    from ..kernels.compensation import compensated_operand, operand_supported

    spec, k = _propagating(recipe.x), x2.shape[-1]
    static = cfg.mode == "static" and layer.rc_channels is not None
    keep = layer.compensation_keep("rc_channels", k) if static else None
    if operand_supported(spec, k):  # x~ in one launch (static) or two (dynamic)
        norms = None if static else layer.qweight_column_sq_norms(x2.dtype)
        a = compensated_operand(x2, spec, cfg.count(k), norms, amax=x_amax, keep=keep)
        return packed_linear(a.to(_compute_dtype(x2)), layer.packed_weight, layer.bias)
    qx = quantize_operand(x2, spec, x_amax)
    if keep is None:
        from ..kernels.top_mask import top_mask

        energy = energy_with_norms((x2 - qx).float(), layer.qweight_column_sq_norms(x2.dtype))
        keep = top_mask(energy, cfg.count(k))
    return packed_linear(torch.where(keep, x2, qx).to(_compute_dtype(x2)), layer.packed_weight,
                         layer.bias)
