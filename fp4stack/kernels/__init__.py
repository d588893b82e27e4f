"""Triton kernels, bit-exact with fp4stack.formats (float32 maths inside)."""

from __future__ import annotations

import functools
import os


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host's grid sizes (triton.cdiv is a constexpr function there, slower
    to call on every launch)."""
    return -(-a // b)


def interpreted() -> bool:
    """Whether Triton kernels run under the interpreter (TRITON_INTERPRET=1, on the CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def available() -> bool:
    """True when Triton imports (CUDA tensors then use the kernels)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def quantize(*args, **kwargs):
    from .nvfp4 import quantize

    return quantize(*args, **kwargs)


def dequantize(*args, **kwargs):
    from .nvfp4 import dequantize

    return dequantize(*args, **kwargs)


def fake_quantize(*args, **kwargs):
    from .nvfp4 import fake_quantize

    return fake_quantize(*args, **kwargs)
