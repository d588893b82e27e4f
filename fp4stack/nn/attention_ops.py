"""The FP4 attention kernels (kernels/attention.py, attention_units.py, attention_bwd.py) as torch
custom ops, which attention_kernels.TritonAttentionFn calls: torch.compile sees each pass as one
node with a fake (shape-only) implementation instead of tracing into Triton launches.

    attention_forward(q, k, v, causal, scale, tiled, seeds of Q, K, V, quant_v)
        -> (out, lse, amaxes [3], units of Q̂, K̂, V̂)
    attention_backward_operands(q, k, v, amaxes, seeds of Q, K; of Q̂ for dK, K̂ for dQ, V̂ for dP,
                                quant_v)
        -> units (Q̂, K̂ along d, V̂ for dP, Q̂ for dK, K̂ for dQ)   (no tensor reuse)
    attention_backward(dO, units, out, lse, amaxes, causal, scale, quant_ds, delta_dp, q_dk?, k_dq?)
        -> (dQ, dK, dV)

quant_v False takes V unquantized (Full-Stack FP4's own attention: only QKᵀ and dS in NVFP4):
V is its own units, its amax RAW_AMAX (a decode factor of exactly 1), and the kernels run as
they are. Stochastic-rounding seeds are int64 tensors of one element (None: round to nearest even),
drawn by the caller from torch's generator, so the graph holds the draws. The kernels run CUDA
tensors, or CPU tensors under the Triton interpreter; on the CPU without it, fp4_attention takes
its torch reference (nn.attention), which torch.compile traces as it is. Each op picks its launch
tiles itself (kernels.attention.tiles_for), from its first input's shape, dtype and device.
As api.py does for the quantizer, `call` skips the op dispatch in eager mode (the same function
runs) and goes through the op under torch.compile.
"""

from __future__ import annotations

import torch
from torch import Tensor


def call(op, *args):
    """op(*args) under torch.compile; eagerly the function the op wraps, without dispatch."""
    return op(*args) if torch.compiler.is_compiling() else _EAGER[op](*args)


def _int(seed: Tensor | None) -> int | None:
    # A seed is a CPU tensor (torch's CPU generator): reading it waits on no device.
    return None if seed is None else int(seed)


def _tiles(t: Tensor):
    from ..kernels.attention import tiles_for

    return tiles_for(t, None)


def _forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, tiled: bool,
             q_seed: Tensor | None, k_seed: Tensor | None, v_seed: Tensor | None,
             quant_v: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out [B, H, S, d] in q's dtype, lse [B, H, S] fp32, the global amaxes of q, k, v [3],
    and the units of Q̂, K̂ (blocks along d) and V̂ (along keys), or all three in 16x16 tiles
    with `tiled`) of q over k, v [B, Hkv, L, d]. quant_v False: V unquantized (amaxes[2] is
    RAW_AMAX, V's units are v itself)."""
    from ..kernels import attention as kernel
    from ..kernels.attention_common import RAW_AMAX
    from ..kernels.attention_units import quantize_operands

    tiles = _tiles(q)
    # A fill, not a copy from the host: the raw V's amax costs no transfer and no pass over V.
    raw = None if quant_v else q.new_full((), RAW_AMAX, dtype=torch.float32)
    amax = kernel.amaxes(q, k, v, v_amax=raw)
    seeds = (_int(q_seed), _int(k_seed), _int(v_seed))
    units = quantize_operands(q, k, v, amax, tiles["quant"], tiled, seeds, quant_v)
    out, lse = kernel.forward_units(*units, amax, causal, scale, tiles["fwd"])
    return out, lse, amax, *units


attention_forward = torch.library.custom_op("fp4stack::attention_forward", _forward,
                                            mutates_args=())


@attention_forward.register_fake
def _(q, k, v, causal, scale, tiled, q_seed, k_seed, v_seed, quant_v=True):
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    units = [t.new_empty(t.shape) for t in (q, k, v)]
    return q.new_empty(q.shape), lse, q.new_empty((3,), dtype=torch.float32), *units


def _backward_operands(q: Tensor, k: Tensor, v: Tensor, amax: Tensor, q_seed: Tensor | None,
                       k_seed: Tensor | None, q_dk_seed: Tensor | None,
                       k_dq_seed: Tensor | None, v_dp_seed: Tensor | None, quant_v: bool = True
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The units of the backward GEMMs without tensor reuse from the raw q, k, v
    (attention_units.backward_operands): Q̂, K̂ along d with the forward's seeds, then V̂ along
    d (quant_v False: V itself), Q̂ along queries and K̂ along keys with fresh ones."""
    from ..kernels.attention_units import backward_operands

    return tuple(backward_operands(
        q, k, v, amax, _tiles(q)["quant"], (_int(q_seed), _int(k_seed)),
        (_int(q_dk_seed), _int(k_dq_seed), _int(v_dp_seed)), quant_v))


attention_backward_operands = torch.library.custom_op(
    "fp4stack::attention_backward_operands", _backward_operands, mutates_args=())


@attention_backward_operands.register_fake
def _(q, k, v, amax, q_seed, k_seed, q_dk_seed, k_dq_seed, v_dp_seed, quant_v=True):
    return tuple(t.new_empty(t.shape) for t in (q, k, v, q, k))


def _backward(do: Tensor, qu: Tensor, ku: Tensor, vu: Tensor, out: Tensor, lse: Tensor,
              amax: Tensor, causal: bool, scale: float, quant_ds: bool, delta_dp: bool,
              q_dk: Tensor | None, k_dq: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(dQ, dK, dV), in the units' dtype, of the forward whose units, output, lse and amaxes
    are given (attention_bwd.backward_units; q_dk, k_dq: the operands of dK and dQ without
    tensor reuse, None with it)."""
    from ..kernels.attention_bwd import backward_units

    dq, dk, dv, _, _ = backward_units(do.to(qu.dtype), qu, ku, vu, out, lse, amax, causal, scale,
                                      _tiles(qu), quant_ds=quant_ds, delta_dp=delta_dp,
                                      q_dk=q_dk, k_dq=k_dq)
    return dq, dk, dv


attention_backward = torch.library.custom_op("fp4stack::attention_backward", _backward,
                                             mutates_args=())


@attention_backward.register_fake
def _(do, qu, ku, vu, out, lse, amax, causal, scale, quant_ds, delta_dp, q_dk, k_dq):
    return torch.empty_like(qu), torch.empty_like(ku), torch.empty_like(vu)


_EAGER = {attention_forward: _forward, attention_backward_operands: _backward_operands,
          attention_backward: _backward}
