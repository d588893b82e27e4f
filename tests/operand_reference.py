"""The linear layers' reference operand, shared by their float64 differential tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fp4stack


def fq(t: torch.Tensor, spec, columnwise: bool = False) -> torch.Tensor:
    """Reference operand: fake_quantize along the last dim, or of tᵀ (token dim padded to 16
    for Hadamard specs), returned as float64."""
    if spec is None or spec.format == "none":
        return t.double()
    if not columnwise:
        return fp4stack.fake_quantize(t, spec=spec).double()
    tt = t.t()
    if spec.hadamard:
        tt = F.pad(tt, (0, -tt.shape[1] % 16))
    return fp4stack.fake_quantize(tt.contiguous(), spec=spec).double().t()
