"""NVFP4 attention with tensor reuse: fp4_attention, the torch reference of Full-Stack FP4's
mixed-precision attention (forward and backward), emulated with exact NVFP4 values and fp32
maths, and use_fp4_attention, which puts it into a model's attention blocks.

Every GEMM quantizes its operands in 1x16 blocks along its own reduction dimension (an NVFP4 GEMM
applies its block scales along K): Q and K along head_dim for S = Q Kᵀ, V along the keys for
O = P V, dS along the keys for dQ and along the queries for dK. AttentionQuant
(attention_quant.py) says which tensors are quantized and whether the backward reuses the
forward's quantized tensors; by default Q, K, V and dS are NVFP4 and the backward multiplies by
the forward's Q̂, K̂, V̂ (tensor reuse). The studies' switches (AttentionQuant.ablation) prepare
their operands in attention_ablation.py. The softmax, its statistics and every accumulation stay
in high precision (fp32; fp64 for fp64 inputs). Any sequence length: quantize_along pads to whole
16-blocks with zeros, which change no scale and add nothing to a product.

fp4_attention(backend="auto") runs the Triton kernels of fp4stack.kernels.attention and
attention_bwd for CUDA tensors where they apply (attention_kernels.py says where), else this
module's reference. use_fp4_attention takes any AttentionBlock: a module with an
`attend(q, k, v, mask=None)` method, as fp4stack's GPT attention has.

docs/attention.md explains the design: the GEMM table, what each AttentionQuant field quantizes,
tensor reuse and its ablations, the kernels' coverage, grouped-query attention and the
causality caveat.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..api import fake_quantize
from ..formats.spec import QuantSpec
from .attention_kernels import TritonAttentionFn, triton_unsupported
from .attention_quant import NVFP4_RNE, NVFP4_SR, NVFP4_TILES, AttentionQuant, stochastic_seed

# The config and its specs are imported from here too (with the functions below).
__all__ = ["NVFP4_RNE", "NVFP4_SR", "NVFP4_TILES", "AttentionBlock", "AttentionQuant",
           "fp4_attention", "make_attend", "quantize_along", "use_fp4_attention"]

_BLOCK = 16


def quantize_along(t: Tensor, spec: QuantSpec | None, dim: int, dtype: torch.dtype,
                   seed: int | None = None, amax: Tensor | None = None) -> Tensor:
    """`t`'s values after `spec` quantizes it in blocks along `dim`, as `dtype`.

    Quantized in fp32 (NVFP4 values are exact there; a bf16 result would round them), with
    `dim` zero-padded to whole blocks; amax: the global amax to scale with (default: t's).
    A 16x16-tile spec quantizes tiles over t's last two dims, whichever of them `dim` is
    (both padded): the same values along either. spec None returns t as `dtype`.
    """
    if spec is None:
        return t.to(dtype)
    if spec.is_2d and dim % t.dim() < t.dim() - 2:
        raise ValueError(f"16x16 tiles run over the last two dims, got dim={dim} of a "
                         f"{t.dim()}-dim tensor")
    x = t.float() if spec.is_2d else t.movedim(dim, -1).float()
    rows, n = x.shape[-2], x.shape[-1]
    pad = (0, -n % _BLOCK, 0, -rows % _BLOCK if spec.is_2d else 0)
    if any(pad):
        x = F.pad(x, pad)
    seed = stochastic_seed(spec) if seed is None else seed
    y = fake_quantize(x.contiguous(), spec=spec, seed=seed, amax=amax)[..., :rows, :n]
    return y.to(dtype) if spec.is_2d else y.to(dtype).movedim(-1, dim)


def _allowed(S: int, L: int, causal: bool, mask: Tensor | None, device) -> Tensor | None:
    """The boolean "may attend" mask, broadcastable to [B, H, S, L], or None (all allowed)."""
    allowed = None
    if causal:  # queries are the last S of L positions: query i sees keys j <= i + L - S
        allowed = torch.ones(S, L, dtype=torch.bool, device=device).tril(L - S)
    if mask is not None:
        allowed = mask if allowed is None else allowed & mask
    return allowed


def _probs(S: Tensor, lse: Tensor) -> Tensor:
    # exp(S - lse): the forward and the backward compute P the same way, so bit for bit alike.
    return torch.exp(S - lse[..., None])


def _scores(qh: Tensor, kh: Tensor, scale: float, allowed: Tensor | None) -> Tensor:
    s = (qh @ kh.transpose(-2, -1)) * scale
    return s if allowed is None else s.masked_fill(~allowed, float("-inf"))


def _log_sum_exp(s: Tensor) -> Tensor:
    """Row log-sum-exp with the row max subtracted first; +inf for a row with no allowed key,
    so that its P is 0 (output 0, as flash attention gives) instead of NaN."""
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    total = torch.exp(s - m).sum(dim=-1)
    lse = m[..., 0] + torch.log(total)
    return torch.where(total > 0, lse, torch.full_like(lse, float("inf")))


def _repeat_heads(t: Tensor, groups: int) -> Tensor:
    """K or V heads repeated for grouped-query attention (query head h reads head h // groups)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _sum_heads(t: Tensor, groups: int) -> Tensor:
    """The gradient of _repeat_heads: each K/V head's sum over the query heads that read it."""
    return t if groups == 1 else t.unflatten(1, (-1, groups)).sum(2)


class _FP4AttentionFn(torch.autograd.Function):
    """K and V come with their own heads (grouped-query attention: fewer than Q's) and are
    quantized so, once per K/V head as a kernel does, then repeated for the query heads that
    read them (a stochastic rounding draws once per K/V head, not once per query head)."""

    @staticmethod
    def forward(ctx, q, k, v, allowed, scale: float, cfg: AttentionQuant):
        dt = torch.float64 if q.dtype == torch.float64 else torch.float32
        groups = q.shape[1] // k.shape[1]
        # stochastic Q, K keep their seeds: the backward recomputes S from the same bits
        q_seed, k_seed = stochastic_seed(cfg.q), stochastic_seed(cfg.k)
        qh = quantize_along(q, cfg.q, -1, dt, q_seed)  # blocks along d: QKᵀ reduces over d
        kh = quantize_along(k, cfg.k, -1, dt, k_seed)
        vh = quantize_along(v, cfg.v, -2, dt)  # blocks along keys: PV reduces over keys
        saved = [hat if cfg.reuses(n) else raw
                 for n, hat, raw in (("q", qh, q), ("k", kh, k), ("v", vh, v))]
        kh, vh = _repeat_heads(kh, groups), _repeat_heads(vh, groups)
        s = _scores(qh, kh, scale, allowed)
        lse = _log_sum_exp(s)
        p = _probs(s, lse)
        p_seed = stochastic_seed(cfg.p)
        o = quantize_along(p, cfg.p, -1, dt, p_seed) @ vh
        amax = cfg.ablation.saved_amaxes(q, k, v) if cfg.ablation is not None else None
        ctx.save_for_backward(*saved, o, lse, allowed, amax)
        ctx.scale, ctx.cfg, ctx.dt, ctx.in_dtype = scale, cfg, dt, q.dtype
        ctx.seeds, ctx.groups = (q_seed, k_seed, p_seed), groups
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        a, b, c, o, lse, allowed, amax = ctx.saved_tensors
        cfg, dt, scale = ctx.cfg, ctx.dt, ctx.scale
        do = do.to(dt)
        q_seed, k_seed, p_seed = ctx.seeds

        def probs(qh: Tensor, kh: Tensor) -> Tensor:
            return _probs(_scores(qh, _repeat_heads(kh, ctx.groups), scale, allowed), lse)

        if cfg.ablation is not None:
            p, p_dv, q_dk, k_dq, v_dp = cfg.ablation.reference_operands(
                cfg, (a, b, c), amax, ctx.seeds, probs, dt)
        elif cfg.reuse:  # the forward's Q̂, K̂, V̂, and P̂ with its seed
            q_dk, k_dq, v_dp = a, b, c
            p = probs(a, b)
            p_dv = quantize_along(p, cfg.p, -1, dt, p_seed)
        else:  # re-quantized along each GEMM's reduction dim; S from the forward's Q̂, K̂ bits
            qh, q_dk = quantize_along(a, cfg.q, -1, dt, q_seed), quantize_along(a, cfg.q, -2, dt)
            kh, k_dq = quantize_along(b, cfg.k, -1, dt, k_seed), quantize_along(b, cfg.k, -2, dt)
            v_dp = quantize_along(c, cfg.v, -1, dt)
            p = probs(qh, kh)
            p_dv = quantize_along(p, cfg.p, -2, dt)
        k_dq, v_dp = _repeat_heads(k_dq, ctx.groups), _repeat_heads(v_dp, ctx.groups)
        dv = p_dv.transpose(-2, -1) @ do
        dp = quantize_along(do, cfg.dp, -1, dt) @ v_dp.transpose(-2, -1)
        delta_dp = cfg.ablation is not None and cfg.ablation.delta == "dp"
        delta = (p * dp if delta_dp else do * o).sum(dim=-1, keepdim=True)
        ds = p * (dp - delta)
        dq = (quantize_along(ds, cfg.ds, -1, dt) @ k_dq) * scale
        dk = (quantize_along(ds, cfg.ds, -2, dt).transpose(-2, -1) @ q_dk) * scale
        dk, dv = _sum_heads(dk, ctx.groups), _sum_heads(dv, ctx.groups)
        out = ctx.in_dtype
        return dq.to(out), dk.to(out), dv.to(out), None, None, None


def fp4_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True,
                  config: AttentionQuant | None = None, scale: float | None = None,
                  mask: Tensor | None = None, backend: str = "auto") -> Tensor:
    """Attention of q [B, H, S, d] over k, v [B, Hkv, L, d] (SDPA layout) with NVFP4 operands.

    q is the last S of the L positions (S < L: KV-cache decoding; causal then masks like
    tril(L - S)). Hkv must divide H (grouped-query attention: query head h reads K/V head
    h // (H / Hkv)). mask: an optional boolean "may attend" tensor broadcastable to
    [B, H, S, L], combined with `causal`. scale defaults to 1/sqrt(d). config defaults to
    AttentionQuant.paper(). The output has q's dtype.

    backend: "torch" this module's reference; "triton" the flash kernels of
    fp4stack.kernels.attention / attention_bwd (an error where they do not apply); "auto" (the
    default) the kernels for CUDA tensors where they apply, else the reference. They apply to
    the default config with either reuse and/or ds=None, with Q, K, V rounded to nearest or
    stochastically or in 16x16 tiles, to V unquantized (AttentionQuant.qk_ds) and to most of
    the default's ablations (kernel_config in
    attention_kernels.py), with mask None, head_dim in (16, 32, 64, 128) and fp32/bf16/fp16
    inputs; on CPU tensors only under the Triton interpreter (TRITON_INTERPRET=1).
    """
    config = AttentionQuant.paper() if config is None else config
    if not isinstance(config, AttentionQuant):
        raise TypeError(f"config must be an AttentionQuant, got {type(config).__name__}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    _check_shapes(q, k, v)
    S, L = q.shape[2], k.shape[2]
    if causal and S > L:
        raise ValueError(f"causal attention needs S <= L (queries are the last S of L "
                         f"positions), got S={S}, L={L}")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a boolean 'may attend' tensor, got {mask.dtype}")
        mask = mask.to(q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if config.ablation is not None:  # rotate_qk, before either backend
        q, k = config.ablation.rotated(q, k)
    why_not = triton_unsupported(q, config, mask) if backend != "torch" else "torch asked"
    if backend == "triton" and why_not:
        raise ValueError(f"fp4_attention(backend='triton'): {why_not}")
    if backend == "triton" or (backend == "auto" and q.is_cuda and not why_not):
        return TritonAttentionFn.apply(q, k, v, causal, scale, config)
    allowed = _allowed(S, L, causal, mask, q.device)
    return _FP4AttentionFn.apply(q, k, v, allowed, scale, config)


_BACKENDS = ("auto", "torch", "triton")


def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, heads, seq, head_dim], got "
                             f"{tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch and "
                         "head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"k/v heads ({k.shape[1]}) must divide q heads ({q.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


@runtime_checkable
class AttentionBlock(Protocol):
    """An attention module whose attention maths use_fp4_attention can replace.

    It computes attention in one place, `attend(q, k, v, mask=None)`: q [B, H, S, d] the last S
    of the L positions in k, v [B, Hkv, L, d] (Hkv divides H; query head h reads K/V head
    h // (H / Hkv)); mask None is causal attention, else a boolean "may attend" tensor
    broadcastable to [B, H, S, L] that already holds causality. It calls `self.attend`, so that
    an `attend` set on the instance takes over (fp4stack.models.gpt.Attention is one). Found by
    duck typing: isinstance(module, AttentionBlock) checks for an `attend` attribute only.
    """

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor: ...


def use_fp4_attention(model: torch.nn.Module, config: AttentionQuant | None = None,
                      backend: str = "auto") -> torch.nn.Module:
    """Make every AttentionBlock of `model` (e.g. an fp4stack GPT's attention) compute
    fp4_attention; returns `model`.

    Overrides each block's `attend` on the instance: mask None is causal attention (q the last
    S of L positions); a mask (the GPT's left-padding mask [B, 1, S, L], already holding
    causality) is used as given. GQA heads are repeated as the original does. backend:
    fp4_attention's (auto: the Triton kernels for CUDA tensors where they apply).
    """
    config = AttentionQuant.paper() if config is None else config
    if not isinstance(config, AttentionQuant):
        raise TypeError(f"config must be an AttentionQuant, got {type(config).__name__}")
    blocks = [m for m in model.modules() if isinstance(m, AttentionBlock)]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no fp4stack Attention block (an "
                         "AttentionBlock: a module with an attend(q, k, v, mask=None) method)")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    for attn in blocks:
        attn.attend = make_attend(config, backend)
    return model


def make_attend(config: AttentionQuant, backend: str = "auto") -> Callable[..., Tensor]:
    """An AttentionBlock's `attend` replacement computing fp4_attention with `config` and
    `backend`."""

    def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        return fp4_attention(q, k, v, causal=mask is None, config=config, mask=mask,
                             backend=backend)

    return attend
