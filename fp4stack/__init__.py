"""fp4stack: stable, fast NVFP4 training of large language models."""

from .api import dequantize, fake_quantize, fake_quantize_stack, quantize, quantize_stack
from .compressed_tensors import load_quantized, save_quantized
from .convert import ConversionSummary, quantize_model
from .formats import (
    FP8Tensor,
    NVFP4Tensor,
    QuantSpec,
    dequantize_fp8,
    fake_quantize_fp8,
    quantize_fp8,
    rht,
    rht_inverse,
    swizzle_scales,
    unswizzle_scales,
)
from .nn import LowRank, QuantLinear, Recipe, ResidualCompensation, recipe
from .transformers_experts import restore_expert_weights

__version__ = "0.1.0"

__all__ = [
    "ConversionSummary", "FP8Tensor", "LowRank", "NVFP4Tensor", "QuantLinear", "QuantSpec",
    "Recipe", "ResidualCompensation", "dequantize", "dequantize_fp8", "fake_quantize",
    "fake_quantize_fp8", "quantize", "quantize_fp8", "quantize_model", "recipe", "rht",
    "rht_inverse", "swizzle_scales", "unswizzle_scales", "load_quantized", "save_quantized",
    "restore_expert_weights", "quantize_stack", "fake_quantize_stack",
]
