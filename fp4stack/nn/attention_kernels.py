"""Which fp4_attention configs the Triton kernels compute, and the autograd function that runs
them (fp4stack.kernels.attention and attention_bwd); fp4stack.nn.attention is the reference and
chooses between the two."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from .attention_quant import NVFP4_RNE, NVFP4_SR, NVFP4_TILES, AttentionQuant, stochastic_seed


def is_tiled(config: AttentionQuant) -> bool:
    """Q, K and V all in NVFP4 16x16 tiles (the kernels' tiled prologue)."""
    return config.q == config.k == config.v == NVFP4_TILES


def kernel_config(config: AttentionQuant) -> bool:
    """Whether the kernels compute `config`: the method's specs, each of Q, K, V rounded to
    nearest (NVFP4_RNE) or stochastically (NVFP4_SR), with any reuse, requantize,
    requantize_along, requantize_rounding and rotate_qk, reblock (round to nearest only), and/or
    ds=None; or Q, K, V in 16x16 tiles with requantize and no reblock (where every reuse gives
    the same numbers); either delta. Other specs stay on the reference."""
    if config.ds not in (None, NVFP4_RNE):
        return False
    how = dict(requantize_along="reduction", requantize_rounding=None)
    if is_tiled(config):
        if config.reblock or not config.requantize or replace(config, **how) != config:
            return False
        config = replace(config, q=NVFP4_RNE, k=NVFP4_RNE, v=NVFP4_RNE)
    specs = [config.q, config.k, config.v]
    if any(s not in (NVFP4_RNE, NVFP4_SR) for s in specs):
        return False
    if config.reblock and (NVFP4_SR in specs or config.requantize_rounding == "stochastic"):
        return False
    # rotate_qk happens before either backend sees Q and K
    flags = dict(q=NVFP4_RNE, k=NVFP4_RNE, v=NVFP4_RNE, reuse=True, requantize=True,
                 reblock=False, ds=NVFP4_RNE, rotate_qk=False, delta="output", **how)
    return replace(config, **flags) == AttentionQuant.paper()


def triton_unsupported(q: Tensor, config: AttentionQuant, mask: Tensor | None) -> str:
    """Why the Triton kernels do not apply ("" when they do)."""
    from ..kernels import available

    if not kernel_config(config):
        return ("the kernels compute the method's specs (Q, K, V rounded to nearest or "
                "stochastically), any reuse and ds=None, and Q, K, V in 16x16 tiles "
                f"(requantize, no reblock) only, got {config.describe()}")
    if mask is not None:
        return "the kernels take no mask (causal or none only)"
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"the kernels take float32, bfloat16 or float16, got {q.dtype}"
    if not available():
        return "Triton is not installed"
    from ..kernels.attention import HEAD_DIMS, interpreted

    if q.shape[-1] not in HEAD_DIMS:
        return f"the kernels take head_dim in {HEAD_DIMS}, got {q.shape[-1]}"
    if not q.is_cuda and not interpreted():
        return "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)"
    return ""


class TritonAttentionFn(torch.autograd.Function):
    """The flash kernels. For each of Q, K, V the forward saves its units if the backward
    reuses it (tensor reuse), else the raw tensor, as the reference does, which the backward
    re-quantizes (attention_units.backward_operands): the same saved memory either way, at the
    price of up to five quantize passes in the backward (cheap next to attention) rather than
    saving up to five units tensors for as long as the graph lives. All save O, lse and the
    amaxes. The backward reuses the tensors cfg.reuses names (all three for 16x16 tiles); with
    cfg.requantize False it takes the others unquantized (unquantized_operands); with
    cfg.reblock the reused units are re-quantized along each GEMM's reduction dim
    (reblocked_operands). Stochastic roundings draw their seeds in the reference's order (Q,
    K, V in the forward; Q̂ for dK, K̂ for dQ, V̂ for dP in the backward), so both backends give
    the same bits after one torch.manual_seed."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, cfg: AttentionQuant):
        from ..kernels import attention as kernel
        from ..kernels import attention_units as units_kernels

        # GQA heads are indexed in-kernel; tiles serve every GEMM, so any reuse is full reuse
        tiled = is_tiled(cfg)
        reused = tuple(n for n in "qkv" if tiled or cfg.reuses(n))
        tiles = kernel.tiles_for(q, None)
        amax = kernel.amaxes(q, k, v)
        seeds = tuple(stochastic_seed(s) for s in (cfg.q, cfg.k, cfg.v))  # None: RNE, tiles
        units = units_kernels.quantize_operands(q, k, v, amax, tiles["quant"], tiled, seeds)
        out, lse = kernel.forward_units(*units, amax, causal, scale, tiles["fwd"])
        saved = [u if n in reused else t for n, u, t in zip("qkv", units, (q, k, v), strict=True)]
        ctx.save_for_backward(*saved, out, lse, amax)
        ctx.causal, ctx.scale, ctx.tiles, ctx.reused, ctx.cfg = causal, scale, tiles, reused, cfg
        ctx.score_seeds = seeds[:2]
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        from ..kernels import attention_units as units_kernels
        from ..kernels.attention_bwd import backward_units

        a, b, c, out, lse, amax = ctx.saved_tensors
        cfg, alt = ctx.cfg, {}
        if ctx.reused == ("q", "k", "v") and not cfg.reblock:
            qu, ku, vu = a, b, c
        elif cfg.requantize:
            fresh = [stochastic_seed(cfg.fresh_spec(spec)) if n not in ctx.reused else None
                     for n, spec in zip("qkv", (cfg.q, cfg.k, cfg.v), strict=True)]
            qu, ku, vu, alt["q_dk"], alt["k_dq"] = units_kernels.backward_operands(
                a, b, c, amax, ctx.tiles["quant"], ctx.reused, ctx.score_seeds, tuple(fresh),
                cfg.requantize_along == "forward")
        else:
            qu, ku, vu, alt["q_dk"], alt["k_dq"], amax = units_kernels.unquantized_operands(
                a, b, c, amax, ctx.reused)
        if cfg.reblock:  # unquantized_operands' amaxes change for the tensors not reused only
            vu, alt["q_dk"], alt["k_dq"] = units_kernels.reblocked_operands(
                vu, alt.get("q_dk", qu), alt.get("k_dq", ku), amax, ctx.tiles["quant"],
                ctx.reused)
        dq, dk, dv, _, _ = backward_units(do.to(qu.dtype), qu, ku, vu, out, lse, amax,
                                          ctx.causal, ctx.scale, ctx.tiles,
                                          quant_ds=cfg.ds is not None,
                                          delta_dp=cfg.delta == "dp", **alt)
        return dq, dk, dv, None, None, None
