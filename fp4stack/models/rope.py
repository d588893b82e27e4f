"""Rotary position embeddings (the rotate-half layout of HF Llama / Qwen) for fp4stack's GPT."""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import available as kernels_available


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """fp32 cos and sin [..., head_dim] for positions [...] ([S] or per row [B, S]), in the
    rotate-half layout of HF Llama/Qwen."""
    # Computed per forward, not stored as buffers, so model.to(bf16) cannot round them.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                              dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, S, H, hd] rotated by position; cos/sin [S, hd] or per row [B, S, hd]. On CUDA,
    where no gradient is wanted (decoding, scoring), one Triton launch with the same bits
    (kernels/rope.py); otherwise `apply_rope_reference`."""
    if (x.is_cuda and not (torch.is_grad_enabled() and x.requires_grad)
            and not torch.compiler.is_compiling() and kernels_available()):
        from ..kernels import rope

        if rope.supported(x, cos):
            return rope.apply_rope(x, cos, sin)
    return apply_rope_reference(x, cos, sin)


def apply_rope_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`apply_rope` in torch ops: the form training differentiates and the kernel matches."""
    # At least fp32: bf16 q/k rotated in bf16 would lose position information at long range.
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    x1, x2 = xf.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)
