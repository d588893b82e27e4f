"""When AdamW4 takes its fused Triton step, and the call into it (kernels/adamw4_step.py).

The fused step implements the default state format (any headroom) for float32, contiguous,
16-byte aligned parameters on CUDA, or on the CPU under the Triton interpreter
(TRITON_INTERPRET=1, for tests); it is bit-exact with the reference step, and the state it
leaves is the same, so a run may switch between the two.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .state_format import StateFormat


def unfusable(fmt: StateFormat) -> str | None:
    """Why the fused step cannot run with this state format here, or None."""
    reason = fmt.unfused_field()
    if reason:
        return reason
    from .. import kernels

    if not kernels.available():
        return "Triton is not installed"
    return None


def param_unfusable(p: Tensor, grad: Tensor, on_cpu: bool) -> str | None:
    """Why a parameter with quantized states (and its gradient) cannot take the fused step, or
    None. on_cpu: the kernels run under the interpreter."""
    if not (p.is_cuda or on_cpu):
        return f"a parameter is on {p.device} (CUDA, or TRITON_INTERPRET=1 on the CPU)"
    if p.dtype != torch.float32 or grad.dtype != torch.float32 or grad.is_sparse:
        return f"needs float32 parameters and dense gradients, got {p.dtype} / {grad.dtype}"
    if not (p.is_contiguous() and grad.is_contiguous()):
        return "needs contiguous parameters and gradients"
    if p.data_ptr() % 16 or grad.data_ptr() % 16 or p.numel() >= 2**31:
        return "needs 16-byte aligned parameters and gradients of < 2**31 elements"
    return None


def grad_still_fusable(grad: Tensor) -> bool:
    """For a parameter accepted before, the checks of its gradient that can change from step to
    step (~0.5 us a parameter, against ~1 us for all of them)."""
    return (grad.dtype is torch.float32 and grad.layout is torch.strided
            and grad.is_contiguous() and not grad.data_ptr() & 15)


def fused_steps(params: list[Tensor], indices: list[int], states: list[dict[str, Tensor]],
                steps: list[float], group: dict[str, Any], headroom: float, cache: dict,
                graphs: bool) -> None:
    """The fused step of a group's parameters whose step counters are `steps` (this step
    included). `cache` keeps the kernels' plans between steps."""
    from ..kernels.adamw4_step import fused_step

    # Launched together only with the same step count (the bias corrections and seeds are
    # per launch): normally all of them.
    by_step: dict[int, list[int]] = {}
    for i, v in enumerate(steps):
        by_step.setdefault(int(v), []).append(i)
    beta1, beta2 = group["betas"]
    for step, members in by_step.items():
        batch = [params[i] for i in members]
        fused_step(
            batch, [p.grad for p in batch], [states[i] for i in members],
            [indices[i] for i in members], step, lr=group["lr"], beta1=beta1, beta2=beta2,
            eps=group["eps"], weight_decay=group["weight_decay"], headroom=headroom,
            seed=group["seed"], cache=cache, graphs=graphs,
        )
