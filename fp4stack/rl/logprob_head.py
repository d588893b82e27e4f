"""Log-probs of target tokens (and the entropy of each distribution) from logits, a chunk of rows
at a time.

Scoring B x L tokens over a vocabulary V the plain way holds several float32 [B, L, V] tensors at
once: the upcast logits, the log-softmax that autograd keeps for the backward, and the entropy's
two temporaries. At a GRPO step of 256 rows of ~110 tokens over SmolLM2's 49,152-token vocabulary
each is 5.6 GB. `target_logprobs` keeps only the logits themselves (in their own dtype, usually
bfloat16) and works through `chunk_elements` values at a time, in the forward and again in the
backward, which recomputes each chunk's log-softmax instead of storing it.

Every row is computed by the same operations as the plain path (`plain_target_logprobs`, kept
as the reference), and a row's log-softmax, gather and entropy read no other row, so the
chunking changes no value: tests/test_logprob_head.py checks the log-probs, the entropy and the
gradient against the plain path bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_ELEMENTS = 1 << 26  # float32 values per chunk: 256 MB


def _chunk_logp(logits: Tensor, temperature: float) -> Tensor:
    x = logits.float()
    if temperature not in (0.0, 1.0):
        x = x / temperature
    return torch.log_softmax(x, dim=-1)


class _TargetLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, rows: int,
                entropy: bool) -> tuple[Tensor, Tensor]:
        flat, idx = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1, 1)
        lp = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        ent = torch.empty(flat.shape[0] if entropy else 0, dtype=torch.float32,
                          device=logits.device)
        for i in range(0, flat.shape[0], rows):
            logp = _chunk_logp(flat[i:i + rows], temperature)
            lp[i:i + rows] = logp.gather(-1, idx[i:i + rows]).squeeze(-1)
            if entropy:
                ent[i:i + rows] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(logits, targets)
        ctx.temperature, ctx.rows = temperature, rows
        ent = ent.view(targets.shape) if entropy else ent
        ctx.mark_non_differentiable(ent)
        return lp.view(targets.shape), ent

    @staticmethod
    def backward(ctx, grad_lp: Tensor, _grad_ent: Tensor):
        logits, targets = ctx.saved_tensors
        t, rows = ctx.temperature, ctx.rows
        flat, idx = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1, 1)
        g = grad_lp.reshape(-1, 1).float()
        out = torch.empty_like(flat)
        for i in range(0, flat.shape[0], rows):
            logp = _chunk_logp(flat[i:i + rows], t)
            # The plain path's chain, op for op: gather's backward (a scatter_add into zeros),
            # log_softmax's, the temperature's division, then the cast back to the logits' dtype.
            d = torch.zeros_like(logp).scatter_add_(-1, idx[i:i + rows], g[i:i + rows])
            d = torch._log_softmax_backward_data(d, logp, -1, torch.float32)
            if t not in (0.0, 1.0):
                d = d / t
            out[i:i + rows] = d.to(flat.dtype)
        return out.view(logits.shape), None, None, None, None


def target_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0,
                    entropy: bool = False, chunk_elements: int = CHUNK_ELEMENTS
                    ) -> Tensor | tuple[Tensor, Tensor]:
    """log softmax(logits / temperature)[..., target] [...] in float32, differentiable in
    `logits` [..., V]; with entropy=True also each distribution's entropy (detached). Memory
    beyond the logits: one chunk of `chunk_elements` float32 values at a time."""
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} must be logits' shape without the "
                         f"vocabulary, {tuple(logits.shape[:-1])}")
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    rows = max(1, chunk_elements // max(1, logits.shape[-1]))
    lp, ent = _TargetLogprobs.apply(logits, targets, float(temperature), rows, entropy)
    return (lp, ent) if entropy else lp


def plain_target_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0,
                          entropy: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """`target_logprobs` the plain way, every float32 [..., V] tensor whole: the reference."""
    logp = _chunk_logp(logits, temperature)
    lp = logp.gather(-1, targets[..., None]).squeeze(-1)
    if not entropy:
        return lp
    with torch.no_grad():
        return lp, -(logp.exp() * logp).sum(-1)
