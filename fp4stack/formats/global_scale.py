"""The per-tensor level of NVFP4's two-level scaling: the global encode and decode scales.

Both come from the tensor's float32 `amax`. The decode scale is `amax * (1 / (6 * scale_max))`,
which is the inverse of the encode scale to within an ulp, except where the encode scale was
capped at FLT_MAX (amax below 2688 / FLT_MAX, about 7.9e-36): there it is the inverse of the
capped scale, 1 / FLT_MAX = 2^-128, so every value decodes with exactly the scale that encoded it
(as Transformer Engine's S_dec = 1 / S_enc does; see docs/NVFP4_SPEC.md).
"""

from __future__ import annotations

import torch

from .e2m1 import E2M1_MAX

FLT_MAX = torch.finfo(torch.float32).max
E4M3_MAX = 448.0
CAPPED_DECODE = 2.0**-128  # fl32(1 / FLT_MAX), exactly: the decode scale of a capped S_enc


def _range(amax: torch.Tensor, scale_max: float) -> torch.Tensor:
    # scale_max * 6 as a float32 tensor beside amax. full_like fills on the device (no copy from
    # the host), so these functions can run inside a CUDA graph capture.
    return torch.full_like(amax, scale_max * E2M1_MAX, dtype=torch.float32)


def global_encode_scale(amax: torch.Tensor, scale_max: float = E4M3_MAX) -> torch.Tensor:
    """S_enc = (scale_max * 6) / amax, capped at FLT_MAX; 1 where amax == 0 or S_enc == 0."""
    s = torch.clamp(_range(amax, scale_max) / amax, max=FLT_MAX)
    return torch.where((amax == 0) | (s == 0), 1.0, s)


def encode_was_capped(amax: torch.Tensor, scale_max: float = E4M3_MAX) -> torch.Tensor:
    """Whether (scale_max * 6) / amax overflows float32, so S_enc is FLT_MAX and not its value."""
    return (amax > 0) & (_range(amax, scale_max) / amax > FLT_MAX)


def global_decode_scale(amax: torch.Tensor, scale_max: float = E4M3_MAX) -> torch.Tensor:
    """D = amax * (1 / (6 * scale_max)), or 2^-128 (= 1 / FLT_MAX) where S_enc was capped."""
    # A Python float multiplies a float32 tensor as float32: amax * fl32(1 / (6 * scale_max)).
    dec = amax * (1.0 / (scale_max * E2M1_MAX))
    return torch.where(encode_was_capped(amax, scale_max), CAPPED_DECODE, dec)
