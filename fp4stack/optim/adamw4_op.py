"""AdamW4's fused step as a torch custom op, `fp4stack::adamw4_step`, for compiled training
steps: torch.compile sees one node that rewrites the parameters and their NVFP4 states in place
(declared as mutated, so its graph orders it and functionalizes around it), with a fake
implementation that does nothing.

On CUDA (Triton backend) the op runs the fused kernels (kernels/adamw4_step.py `fused_step`,
without CUDA graphs: a compiled graph may hand it other buffers each call); elsewhere the
reference step (the AdamW4 `_step_param` maths: read_moments, quantized_update, store_moments)
on each parameter, the same bits. Both implement AdamW4's default state format with any
headroom, for float32 parameters whose states have been stepped `step` times, this one
included. E4M3 scales cross the op boundary as their bytes (uint8 views), as in fp4stack.ops.
AdamW4.step keeps calling the kernels directly (its per-step host work, plan caching and CUDA
graphs are its own); `adamw4_step` is the entry point for code that compiles the update.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..ops import backend_for
from .adamw4_state import read_moments, store_moments
from .adamw_updates import quantized_update
from .state_format import StateFormat

# The state fields the step rewrites (kernels/adamw4_layout.FIELDS, whose module needs Triton).
FIELDS = ("exp_avg_data", "exp_avg_scales", "exp_avg_amax", "exp_avg_next_amax",
          "exp_avg_sq_data", "exp_avg_sq_scales", "exp_avg_sq_amax", "exp_avg_sq_next_amax",
          "exp_avg_sq_row", "exp_avg_sq_col")
_SCALES = ("exp_avg_scales", "exp_avg_sq_scales")
_PLANS: dict = {}  # the kernels' plans (device tables, buffers), as AdamW4 keeps its own


def _states(fields: tuple[list[Tensor], ...]) -> list[dict[str, Tensor]]:
    """Per parameter, its state fields by name, the scales as float8_e4m3fn again."""
    states = []
    for tensors in zip(*fields, strict=True):
        state = dict(zip(FIELDS, tensors, strict=True))
        for name in _SCALES:
            state[name] = state[name].view(torch.float8_e4m3fn)
        states.append(state)
    return states


@torch.library.custom_op("fp4stack::adamw4_step", mutates_args=("params", *FIELDS))
def adamw4_step_op(params: list[Tensor], grads: list[Tensor], exp_avg_data: list[Tensor],
                   exp_avg_scales: list[Tensor], exp_avg_amax: list[Tensor],
                   exp_avg_next_amax: list[Tensor], exp_avg_sq_data: list[Tensor],
                   exp_avg_sq_scales: list[Tensor], exp_avg_sq_amax: list[Tensor],
                   exp_avg_sq_next_amax: list[Tensor], exp_avg_sq_row: list[Tensor],
                   exp_avg_sq_col: list[Tensor], indices: list[int], step: int, lr: float,
                   beta1: float, beta2: float, eps: float, weight_decay: float,
                   headroom: float, seed: int) -> None:
    """One AdamW4 step of float32 `params` (their optimizer `indices`, for the rounding seeds)
    with gradients `grads`, every state field rewritten in place (scales as uint8 bytes)."""
    states = _states((exp_avg_data, exp_avg_scales, exp_avg_amax, exp_avg_next_amax,
                      exp_avg_sq_data, exp_avg_sq_scales, exp_avg_sq_amax,
                      exp_avg_sq_next_amax, exp_avg_sq_row, exp_avg_sq_col))
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    if params and params[0].is_cuda and backend_for(params[0].device) == "triton":
        from ..kernels.adamw4_step import fused_step

        fused_step(params, grads, states, indices, step, **hyper, headroom=headroom, seed=seed,
                   cache=_PLANS, graphs=False)
        return
    fmt = StateFormat(headroom=headroom)
    for p, g, state, index in zip(params, grads, states, indices, strict=True):
        reference_step(p, g, state, index, step, fmt, seed, hyper)


@adamw4_step_op.register_fake
def _(params, grads, exp_avg_data, exp_avg_scales, exp_avg_amax, exp_avg_next_amax,
      exp_avg_sq_data, exp_avg_sq_scales, exp_avg_sq_amax, exp_avg_sq_next_amax, exp_avg_sq_row,
      exp_avg_sq_col, indices, step, lr, beta1, beta2, eps, weight_decay, headroom, seed):
    return None


def reference_step(p: Tensor, grad: Tensor, state: dict[str, Tensor], index: int, step: int,
                   fmt: StateFormat, seed: int, hyper: dict[str, float]) -> None:
    """AdamW4's reference step of one float32 parameter, its state tensors rewritten in place
    (store_moments makes new ones: their values are copied back)."""
    work = dict(state)
    m, v = read_moments(work, fmt, p.shape)
    quantized_update(p, grad.float(), m, v, float(step), hyper["lr"], hyper["beta1"],
                     hyper["beta2"], hyper["eps"], hyper["weight_decay"])
    store_moments(work, fmt, seed, index, step, m, v)
    for name in FIELDS:
        state[name].copy_(work[name])


def adamw4_step(params: list[Tensor], grads: list[Tensor], states: list[dict[str, Any]],
                indices: list[int], step: int, *, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float, headroom: float, seed: int) -> None:
    """`adamw4_step_op` of AdamW4 states (dicts holding FIELDS, as AdamW4.state keeps them)."""
    fields = [[s[name].view(torch.uint8) if name in _SCALES else s[name] for s in states]
              for name in FIELDS]
    adamw4_step_op(params, grads, *fields, indices, step, lr, beta1, beta2, eps, weight_decay,
                   headroom, seed)
