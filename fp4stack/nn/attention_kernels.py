"""Which fp4_attention configs the Triton kernels compute, and the autograd function that runs
them (fp4stack.kernels.attention and attention_bwd, as the custom ops of attention_ops.py);
fp4stack.nn.attention is the reference and chooses between the two."""

from __future__ import annotations

import torch
from torch import Tensor

from ..formats.random import draw_seed_tensor
from ..formats.spec import QuantSpec
from .attention_ops import (
    attention_backward,
    attention_backward_operands,
    attention_forward,
    call,
)
from .attention_quant import NVFP4_RNE, NVFP4_SR, NVFP4_TILES, AttentionQuant


def is_tiled(config: AttentionQuant) -> bool:
    """Q, K and V all in NVFP4 16x16 tiles (the kernels' tiled prologue)."""
    return config.q == config.k == config.v == NVFP4_TILES


def kernel_config(config: AttentionQuant) -> bool:
    """Whether the kernels compute `config`: the method's specs, each of Q, K, V rounded to
    nearest (NVFP4_RNE) or stochastically (NVFP4_SR), or all three in 16x16 tiles, with either
    reuse and/or ds=None, P and dP in high precision, and the ablations
    AttentionAblation.in_kernels accepts; also V unquantized without an ablation (the paper's
    form, AttentionQuant.qk_ds). Other specs stay on the reference."""
    # Field reads and comparisons only: torch.compile traces them on every torch it supports
    # (torch 2.11's dynamo cannot pass a frozen dataclass to an assume_constant_result function,
    # nor build one with dataclasses.replace). KERNEL_FIELDS keeps the list whole (a test).
    if config.p is not None or config.dp is not None:
        return False
    if config.ds is not None and config.ds != NVFP4_RNE:
        return False
    tiled = is_tiled(config)
    if not tiled:
        for spec in (config.q, config.k):
            if spec != NVFP4_RNE and spec != NVFP4_SR:
                return False
        if config.v is None:  # V taken raw (attention_ops: quant_v False)
            return config.ablation is None
        if config.v != NVFP4_RNE and config.v != NVFP4_SR:
            return False
    if config.ablation is not None:
        stochastic = not tiled and NVFP4_SR in (config.q, config.k, config.v)
        return config.ablation.in_kernels(tiled, stochastic)
    return True


# The AttentionQuant fields kernel_config reads (reuse: the kernels take either).
KERNEL_FIELDS = ("q", "k", "v", "p", "ds", "dp", "reuse", "ablation")


def triton_unsupported(q: Tensor, config: AttentionQuant, mask: Tensor | None) -> str:
    """Why the Triton kernels do not apply ("" when they do)."""
    from ..kernels import available

    if not kernel_config(config):
        return ("the kernels compute the method's specs (Q, K, V rounded to nearest or "
                "stochastically, or V unquantized), any reuse and ds=None, and Q, K, V in 16x16 "
                f"tiles (requantize, no reblock) only, got {config.describe()}")
    if mask is not None:
        return "the kernels take no mask (causal or none only)"
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"the kernels take float32, bfloat16 or float16, got {q.dtype}"
    if not available():
        return "Triton is not installed"
    from ..kernels import interpreted
    from ..kernels.attention import HEAD_DIMS

    if q.shape[-1] not in HEAD_DIMS:
        return f"the kernels take head_dim in {HEAD_DIMS}, got {q.shape[-1]}"
    if not q.is_cuda and not interpreted():
        return "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)"
    return ""


class TritonAttentionFn(torch.autograd.Function):
    """The flash kernels, through the custom ops of attention_ops.py. For each of Q, K, V the
    forward saves its units if the backward reuses it (tensor reuse; all three for 16x16 tiles,
    which serve every GEMM), else the raw tensor, as the reference does, which the backward
    re-quantizes (attention_units.backward_operands): the same saved memory either way, at the
    price of up to five quantize passes in the backward (cheap next to attention) rather than
    saving up to five units tensors for as long as the graph lives. All save O, lse and the
    amaxes. An ablation prepares the backward's operands itself
    (AttentionAblation.units_operands, outside the ops). Stochastic roundings draw their seeds
    (as tensors: torch.compile keeps the draws in its graph) in the reference's order (Q, K, V
    in the forward; Q̂ for dK, K̂ for dQ, V̂ for dP in the backward), so both backends give the
    same bits after one torch.manual_seed."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, cfg: AttentionQuant):
        # GQA heads are indexed in-kernel
        tiled = is_tiled(cfg)
        reused = tuple(n for n in "qkv" if tiled or cfg.reuses(n))
        seeds = tuple(_seed(s) for s in (cfg.q, cfg.k, cfg.v))  # None: RNE, tiles, raw V
        out, lse, amax, *units = call(attention_forward, q, k, v, causal, scale, tiled, *seeds,
                                      cfg.v is not None)
        saved = [u if n in reused else t for n, u, t in zip("qkv", units, (q, k, v), strict=True)]
        ctx.save_for_backward(*saved, out, lse, amax, *seeds[:2])
        ctx.causal, ctx.scale, ctx.reused, ctx.cfg = causal, scale, reused, cfg
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        a, b, c, out, lse, amax, q_seed, k_seed = ctx.saved_tensors
        cfg = ctx.cfg
        q_dk = k_dq = None
        if cfg.ablation is not None:
            from ..kernels.attention import tiles_for

            score_seeds = tuple(None if s is None else int(s) for s in (q_seed, k_seed))
            qu, ku, vu, alt, amax = cfg.ablation.units_operands(
                cfg, (a, b, c), amax, tiles_for(a, None)["quant"], ctx.reused, score_seeds)
            q_dk, k_dq = alt.get("q_dk"), alt.get("k_dq")
        elif ctx.reused:
            qu, ku, vu = a, b, c
        else:
            seeds = tuple(_seed(s) for s in (cfg.q, cfg.k, cfg.v))
            qu, ku, vu, q_dk, k_dq = call(attention_backward_operands, a, b, c, amax, q_seed,
                                          k_seed, *seeds, cfg.v is not None)
        delta_dp = cfg.ablation is not None and cfg.ablation.delta == "dp"
        dq, dk, dv = call(attention_backward, do, qu, ku, vu, out, lse, amax, ctx.causal,
                          ctx.scale, cfg.ds is not None, delta_dp, q_dk, k_dq)
        return dq, dk, dv, None, None, None


def _seed(spec: QuantSpec | None) -> Tensor | None:
    """`stochastic_seed`'s draw as an int64 tensor (the same value; no host read)."""
    return draw_seed_tensor() if spec is not None and spec.rounding == "stochastic" else None
