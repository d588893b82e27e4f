"""The NVFP4 specification as readable PyTorch (the reference every kernel is tested against)."""

from .fp8 import FP8Tensor, dequantize_fp8, fake_quantize_fp8, quantize_fp8
from .global_scale import global_decode_scale
from .hadamard import rht, rht_inverse, rht_matrix
from .nvfp4 import dequantize, fake_quantize, global_encode_scale, quantize
from .spec import QuantSpec
from .swizzle import swizzle_scales, unswizzle_scales
from .tensor import NVFP4Tensor

__all__ = [
    "FP8Tensor", "NVFP4Tensor", "QuantSpec", "dequantize", "dequantize_fp8", "fake_quantize",
    "fake_quantize_fp8", "global_decode_scale", "global_encode_scale", "quantize",
    "quantize_fp8", "rht", "rht_inverse", "rht_matrix", "swizzle_scales", "unswizzle_scales",
]
