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


# The backend module's functions (ops.impl returns this package for CUDA tensors, as it returns
# formats.nvfp4 for the others): loaded from kernels/nvfp4.py on first use, so importing the
# package does not import Triton.
BACKEND_FUNCTIONS = ("quantize", "dequantize", "fake_quantize", "fake_quantize_pair",
                     "quantize_units", "quantize_stack", "fake_quantize_stack")


def __getattr__(name: str):
    if name in BACKEND_FUNCTIONS:
        from . import nvfp4

        return getattr(nvfp4, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
