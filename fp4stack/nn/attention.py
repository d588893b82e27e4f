"""NVFP4 attention with tensor reuse: the torch reference of Full-Stack FP4's mixed-precision
attention (forward and backward), emulated with exact NVFP4 values and fp32 maths.

Every GEMM quantizes its operands in 1x16 blocks along that GEMM's reduction dimension, because an
NVFP4 GEMM applies its block scales along K. Shapes: Q [S, d], K and V [L, d], P and dS [S, L]
(per batch and head); "queries" is S, "keys" is L, d is head_dim.

| GEMM        | operands | reduction | blocks run along                     | quantized by default |
|-------------|----------|-----------|--------------------------------------|----------------------|
| S = Q Kᵀ    | Q, K     | d         | d                                    | Q, K                 |
| O = P V     | P, V     | keys      | keys (P rows, V columns)             | V (P stays fp32)     |
| dV = Pᵀ dO  | P, dO    | queries   | queries (reuse: P̂ as in O = P V)     | nothing              |
| dP = dO Vᵀ  | dO, V    | d         | d (reuse: V̂ as in O = P V, keys)     | V (dO stays fp32)    |
| dQ = dS K   | dS, K    | keys      | keys (reuse: K̂ as in S = Q Kᵀ, d)    | dS, K                |
| dK = dSᵀ Q  | dS, Q    | queries   | queries (reuse: Q̂ as in S = Q Kᵀ, d) | dS, Q                |

Which tensor each flag of AttentionQuant quantizes: `q`, `k`, `v` the inputs, wherever they are a
GEMM operand; `p` the probabilities as an operand of O = P V and of dV = Pᵀ dO; `dp` the dO operand
of the dP GEMM (the path SageBwd keeps in FP16); `ds` the score gradient, along keys for dQ and
along queries for dK (it only exists in the backward, so it is quantized there, once per GEMM).
dO in dV = Pᵀ dO is never quantized: the method names no quantizer for it.

Tensor reuse (reuse=True, the method's choice): the backward multiplies by the very values the
forward did. Q̂, K̂ (blocks along d) and V̂ (blocks along keys) are saved and never re-quantized;
S is recomputed from Q̂ K̂ᵀ bit for bit, so P, and P̂ (same seed), are the forward's too. dP = dO V̂ᵀ,
dQ = dS K̂ and dK = dSᵀ Q̂ then reuse operands whose blocks run along a dimension other than the
GEMM's reduction: the numbers stay aligned with the forward, which is the point.
reuse=False (the ablation): Q, K, V are saved unquantized and the backward re-quantizes each along
its GEMM's reduction dim: V along d for dP, K along keys for dQ, Q along queries for dK, P along
queries for dV (and Q, K along d again to recompute S). The backward then differentiates slightly
different numbers from the ones the forward used. reuse=("v",), ("q", "k") and so on reuse the
named tensors only (AttentionQuant), to find out which reuse matters. requantize_along="forward"
re-quantizes them along the forward's block dims instead, and requantize_rounding="stochastic"
with fresh stochastic rounding: the ablation of whether the block dims or the rounding make no
reuse train better. S is always recomputed from the forward's Q̂, K̂ bits (a stochastic Q or K
spec keeps its forward seed for that).
reblock=True (with reuse): the reused values go into dP, dQ, dK (and dV for P̂) re-quantized
along those GEMMs' reduction dims, with the forward's global amaxes: the forward's numbers in the
blocks a native NVFP4 GEMM needs (reuse as such is only possible where the GEMM runs on
dequantized operands, as in this emulation), at the price of a second rounding.
16x16 tiles (AttentionQuant.q, k, v = NVFP4_TILES): one scale per 16 tokens x 16 head dims, so
each block runs along both dims and one quantization of Q, K, V is the right operand of every
GEMM in both passes; reuse, no reuse and reblock then give the same numbers.
rotate_qk=True: Q and K enter as Q R and K R, R = blockdiag(diag(s) H16 / 4) along d (the 16-point
random Hadamard transform, computed in torch before either backend, bit-exact on CPU and GPU).
R is orthogonal, so S = (QR)(KR)ᵀ = QKᵀ before quantization, and autograd takes dQ, dK back
through Rᵀ; what changes is which values Q̂, K̂ round to, since a block's outliers spread out.

delta="dp": dS = P ∘ (dP - rowsum(P ∘ dP)) instead of flash attention's rowsum(dO ∘ O), the
softmax's gradient for the backward's own dP. With the forward's V̂ in dP (reuse) the two are the
same sum; with another V' (no reuse, re-blocked V̂) only "dp" keeps each row of dS summing to 0.

Kept high precision, as the method says: softmax and its statistics (the log-sum-exp per row,
saved for the backward as flash attention does), dP, dS before quantization, the rowsum(dO ∘ O)
term and every accumulation (fp32; fp64 when the inputs are fp64, for tight tests). Unquantized
operands stay fp32 in this emulation, an upper bound on what BF16 P or dO would give.

Any sequence length: quantize_along pads the dimension its blocks run along to whole 16-blocks
with zeros, which change neither a block's max nor the global amax and add nothing to a product,
and cuts them off again. Masked scores give P = 0 and dS = 0, so they contribute nothing either.

Triton kernels: fp4_attention(backend="auto") runs fp4stack.kernels.attention (forward) and
attention_bwd (backward) for CUDA tensors when the config is the default or one of its ablations
AttentionQuant(reuse=...) of any reuse, AttentionQuant(ds=None) (or both), Q, K, V rounded
stochastically (NVFP4_SR) or re-quantized in the backward as requantize_along /
requantize_rounding say (not with reblock), or Q, K, V in 16x16 tiles (with requantize and
without reblock), any of them with rotate_qk and either delta, mask is None, head_dim is
16/32/64/128 and the dtype fp32/bf16/fp16; the same maths in flash-attention tiles, with the
same quantized values (bit-exact tiles; stochastic ones with the same seeds, drawn in the same
order) and sums in another order (ds=None with 16-bit inputs: dS is rounded to that dtype for
its dots, where the reference keeps fp32). Everything else (p or dp quantized, q, k or v not,
other specs), and CPU tensors, run this module's torch reference (backend="torch" forces it).

Grouped-query attention: K and V are quantized once per K/V head, then repeated for the query
heads that read them (as the kernels index them), so a stochastic rounding of K or V draws once
per K/V head.

Causality caveat: V's blocks run along keys, so a past token's V̂ shares its block scale with up to
15 later tokens, and every quantizer's global amax spans all positions. Masked keys still get zero
weight and zero gradient, but a future token can nudge the quantized values of past ones.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..api import fake_quantize
from ..formats.hadamard import rht
from ..formats.spec import QuantSpec
from .attention_kernels import TritonAttentionFn, triton_unsupported
from .attention_quant import NVFP4_RNE, NVFP4_SR, NVFP4_TILES, AttentionQuant, stochastic_seed

# The config and its specs are imported from here too (with the functions below).
__all__ = ["NVFP4_RNE", "NVFP4_SR", "NVFP4_TILES", "AttentionQuant", "fp4_attention",
           "make_attend", "quantize_along", "use_fp4_attention"]

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
        # reblock: Q's, K's and V's global amaxes (the forward's scales) for the second
        # quantization of the reused values
        amax = torch.stack([t.float().abs().amax() for t in (q, k, v)]) if cfg.reblock else None
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
        # Reused: the forward's values (Q̂, K̂ along d, V̂ along keys, P̂ with its seed), with
        # reblock re-quantized along the GEMM's reduction dim at the forward's amax; else
        # re-quantized from the unquantized tensor along each GEMM's reduction dim (or as
        # requantize_along/requantize_rounding say), or (not requantize) the unquantized tensor
        # itself. S is recomputed from the forward's Q̂, K̂ bits unless requantize=False.
        def scores_operand(t: Tensor, spec: QuantSpec | None, seed: int | None) -> Tensor:
            return quantize_along(t, spec if cfg.requantize else None, -1, dt, seed)

        def fresh(t: Tensor, spec: QuantSpec | None, dim: int, forward_dim: int) -> Tensor:
            dim = forward_dim if cfg.requantize_along == "forward" else dim
            return quantize_along(t, cfg.fresh_spec(spec) if cfg.requantize else None, dim, dt)

        def reused(hat: Tensor, spec: QuantSpec | None, dim: int, amax: Tensor | None) -> Tensor:
            return quantize_along(hat, spec, dim, dt, amax=amax) if cfg.reblock else hat

        amax = (None, None, None) if amax is None else amax
        if cfg.reuses("q"):
            qh, q_dk = a, reused(a, cfg.q, -2, amax[0])
        else:
            qh, q_dk = scores_operand(a, cfg.q, q_seed), fresh(a, cfg.q, -2, -1)
        if cfg.reuses("k"):
            kh, k_dq = b, reused(b, cfg.k, -2, amax[1])
        else:
            kh, k_dq = scores_operand(b, cfg.k, k_seed), fresh(b, cfg.k, -2, -1)
        v_dp = reused(c, cfg.v, -1, amax[2]) if cfg.reuses("v") else fresh(c, cfg.v, -1, -2)
        kh, k_dq, v_dp = (_repeat_heads(t, ctx.groups) for t in (kh, k_dq, v_dp))
        p = _probs(_scores(qh, kh, scale, allowed), lse)
        if cfg.reuses("p"):  # P is recomputed bit for bit, so its amax is the forward's
            p_amax = p.float().abs().amax() if cfg.reblock and cfg.p is not None else None
            p_dv = reused(quantize_along(p, cfg.p, -1, dt, p_seed), cfg.p, -2, p_amax)
        else:
            p_dv = fresh(p, cfg.p, -2, -1)
        dv = p_dv.transpose(-2, -1) @ do
        dp = quantize_along(do, cfg.dp, -1, dt) @ v_dp.transpose(-2, -1)
        delta = (p * dp if cfg.delta == "dp" else do * o).sum(dim=-1, keepdim=True)
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
    the default config with any reuse and/or ds=None, with Q, K, V rounded to nearest or
    stochastically and any requantize_along / requantize_rounding, and to Q, K, V in 16x16
    tiles, with either delta, mask None, head_dim in (16, 32, 64, 128) and fp32/bf16/fp16
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
    if config.rotate_qk:
        if q.shape[-1] % _BLOCK:
            raise ValueError(f"AttentionQuant.rotate_qk=True needs head_dim to be a multiple "
                             f"of {_BLOCK}, got {q.shape[-1]}: set rotate_qk=False")
        q, k = _rotate(q), _rotate(k)
    why_not = triton_unsupported(q, config, mask) if backend != "torch" else "torch asked"
    if backend == "triton" and why_not:
        raise ValueError(f"fp4_attention(backend='triton'): {why_not}")
    if backend == "triton" or (backend == "auto" and q.is_cuda and not why_not):
        return TritonAttentionFn.apply(q, k, v, causal, scale, config)
    allowed = _allowed(S, L, causal, mask, q.device)
    return _FP4AttentionFn.apply(q, k, v, allowed, scale, config)


_BACKENDS = ("auto", "torch", "triton")


def _rotate(t: Tensor) -> Tensor:
    # the fixed butterfly order of rht keeps CPU and GPU bit-identical; autograd backs through it
    return rht(t).to(t.dtype)


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


def use_fp4_attention(model, config: AttentionQuant | None = None, backend: str = "auto"):
    """Make every attention block of an fp4stack GPT compute fp4_attention; returns `model`.

    Overrides each block's `Attention.attend` on the instance: mask None is causal attention
    (q the last S of L positions); the left-padding mask the GPT passes ([B, 1, S, L], already
    holding causality) is used as given. GQA heads are repeated as the original does. backend:
    fp4_attention's (auto: the Triton kernels for CUDA tensors where they apply).
    """
    from ..models.gpt import Attention

    config = AttentionQuant.paper() if config is None else config
    if not isinstance(config, AttentionQuant):
        raise TypeError(f"config must be an AttentionQuant, got {type(config).__name__}")
    blocks = [m for m in model.modules() if isinstance(m, Attention)]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no fp4stack Attention block")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    for attn in blocks:
        attn.attend = make_attend(config, backend)
    return model


def make_attend(config: AttentionQuant, backend: str = "auto"):
    """An `Attention.attend` replacement computing fp4_attention with `config` and `backend`."""

    def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        return fp4_attention(q, k, v, causal=mask is None, config=config, mask=mask,
                             backend=backend)

    return attend
