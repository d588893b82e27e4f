"""Flash-attention-style Triton forward of NVFP4 attention (the default AttentionQuant: Q, K, V
in NVFP4 1x16 RNE, P unquantized), matching fp4stack.nn.attention.fp4_attention.

Each program takes BLOCK_M queries of one (batch, head) and walks the keys BLOCK_N at a time. It
quantizes its tiles itself, from the caller's global amaxes, with the jit helpers of the NVFP4
kernels (so the values are bit for bit the reference's): Q and K in 16-wide blocks along d, V in
16-key blocks along the keys. BLOCK_N is a power of two >= 16 and tiles start at multiples of it, so
V's blocks are the reference's; keys past L load as zeros, which is the reference's zero padding.

The dots take the quantized values in units of their global scale (E2M1 value times E4M3 block
scale: at most 6 significant bits, exact in bf16, fp16 and tf32) and the global scales are
applied to the fp32 result. fp32 inputs use fp32 dots; 16-bit inputs use dots in their own
dtype (P is rounded to it there), always with fp32 accumulation and an fp32 online softmax.
Under the interpreter, whose 16-bit dots are wrong, operands are rounded to that dtype and
multiplied in fp32.

Speed has not been measured: this was written and tested under the Triton interpreter on a CPU.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ..formats.spec import QuantSpec
from . import nvfp4_jit as jit
from .nvfp4 import _launch_options

HEAD_DIMS = (16, 32, 64, 128)
SCALE_MAX = QuantSpec().scale_max  # E4M3's 448


@triton.jit
def quantize_tile(x, amax, BLOCK_AXIS: tl.constexpr, SCALE_MAX: tl.constexpr):
    """NVFP4 RNE of a [R, C] fp32 tile in 16-element blocks along axis BLOCK_AXIS.

    Returns (units, dec): the dequantized values are units * dec, as the fake-quantize kernel
    computes them; units = E2M1 value * E4M3 block scale.
    """
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    s_enc, s_dec = jit.global_scales(amax, SCALE_MAX)
    if BLOCK_AXIS == 1:
        xb = tl.reshape(x, (R, C // 16, 16))
        sbits = jit.block_scale_bits(tl.reduce(tl.abs(xb), 2, jit.max_nan), s_enc, 1.0 / 6.0)
        enc = jit.encode_factor(sbits, s_dec)[:, :, None]
        s = jit.e4m3_value(sbits)[:, :, None]
    else:
        xb = tl.reshape(x, (R // 16, 16, C))
        sbits = jit.block_scale_bits(tl.reduce(tl.abs(xb), 1, jit.max_nan), s_enc, 1.0 / 6.0)
        enc = jit.encode_factor(sbits, s_dec)[:, None, :]
        s = jit.e4m3_value(sbits)[:, None, :]
    units = jit.e2m1_rne_value(xb * enc) * s
    return tl.reshape(units, (R, C)), amax * (1.0 / (SCALE_MAX * 6.0))


@triton.jit
def attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, amax_ptr, qh_ptr, kh_ptr, vh_ptr,
    H, S, L, scale,
    sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sob, soh, sos, sod,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_TY: tl.constexpr, MMA_TY: tl.constexpr, PRECISION: tl.constexpr, SCALE_MAX: tl.constexpr,
    DEBUG: tl.constexpr,
):
    """Output rows [BLOCK_M, D] and their log-sum-exp for one (batch, head).

    DEBUG=True also writes the dequantized Q̂, K̂, V̂ tiles it computed to qh, kh, vh
    (contiguous [B, H, *, D] fp32; programs that share a K/V tile write the same values).
    """
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, D)
    row_ok = rows < S
    q_base = q_ptr + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    q = tl.load(q_base + rows[:, None].to(tl.int64) * sqs + cols[None, :] * sqd,
                mask=row_ok[:, None], other=0.0).to(tl.float32)
    q_units, q_dec = quantize_tile(q, tl.load(amax_ptr), 1, SCALE_MAX)
    k_amax = tl.load(amax_ptr + 1)
    v_amax = tl.load(amax_ptr + 2)
    if DEBUG:
        ptr = qh_ptr + (bh.to(tl.int64) * S + rows[:, None]) * D + cols[None, :]
        tl.store(ptr, q_units * q_dec, mask=row_ok[:, None])
    q_dot = q_units.to(DOT_TY).to(MMA_TY)

    k_base = k_ptr + b.to(tl.int64) * skb + h.to(tl.int64) * skh
    v_base = v_ptr + b.to(tl.int64) * svb + h.to(tl.int64) * svh
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    # Queries are the last S of L positions: query i sees keys j <= i + L - S.
    hi = L
    if CAUSAL:
        hi = tl.minimum(L, (pid_m + 1) * BLOCK_M + L - S)
    for start_n in range(0, hi, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        key_ok = keys < L
        # Keys past L are zeros: the reference's padding of V's last 16-block.
        k = tl.load(k_base + keys[:, None].to(tl.int64) * sks + cols[None, :] * skd,
                    mask=key_ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_base + keys[:, None].to(tl.int64) * svs + cols[None, :] * svd,
                    mask=key_ok[:, None], other=0.0).to(tl.float32)
        k_units, k_dec = quantize_tile(k, k_amax, 1, SCALE_MAX)
        v_units, v_dec = quantize_tile(v, v_amax, 0, SCALE_MAX)
        if DEBUG:
            off = (bh.to(tl.int64) * L + keys[:, None]) * D + cols[None, :]
            tl.store(kh_ptr + off, k_units * k_dec, mask=key_ok[:, None])
            tl.store(vh_ptr + off, v_units * v_dec, mask=key_ok[:, None])

        s = tl.dot(q_dot, tl.trans(k_units.to(DOT_TY).to(MMA_TY)), input_precision=PRECISION)
        s = s * (q_dec * k_dec * scale)
        allowed = key_ok[None, :]
        if CAUSAL:
            allowed = allowed & (keys[None, :] <= rows[:, None] + (L - S))
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no allowed key yet keeps max -inf: shift by 0 there, so exp gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p_dot = p.to(DOT_TY).to(MMA_TY)
        pv = tl.dot(p_dot, v_units.to(DOT_TY).to(MMA_TY), input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv * v_dec
        m_i = m_new

    # A row with no allowed key: output 0 and lse +inf, as the reference.
    has_key = l_i > 0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = tl.where(has_key, m_i + tl.log(l_i), float("inf"))
    o_base = o_ptr + b.to(tl.int64) * sob + h.to(tl.int64) * soh
    tl.store(o_base + rows[:, None].to(tl.int64) * sos + cols[None, :] * sod,
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + bh.to(tl.int64) * S + rows, lse, mask=row_ok)


def _amaxes(q, k, v, q_amax, k_amax, v_amax) -> torch.Tensor:
    """The three global amaxes as one fp32 tensor on q's device (None: computed here)."""
    out = []
    for t, a in ((q, q_amax), (k, k_amax), (v, v_amax)):
        a = t.float().abs().amax() if a is None else a
        out.append(torch.as_tensor(a, dtype=torch.float32, device=q.device).reshape(()))
    return torch.stack(out)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"need q [B, H, S, d] and k, v [B, H, L, d], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError("q, k, v must share batch, heads (repeat GQA heads first) and head_dim")
    if q.shape[3] not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {q.shape[3]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"q, k, v must be float32, bfloat16 or float16, got {q.dtype}")
    if causal and q.shape[2] > k.shape[2]:
        raise ValueError(f"causal attention needs S <= L, got S={q.shape[2]}, L={k.shape[2]}")


def _launch(q, k, v, causal, scale, amaxes, block_m, block_n, debug):
    _check(q, k, v, causal)
    # Powers of two (tl.arange); block_n >= 16 keeps V's 16-key blocks inside one tile.
    for name, n in (("block_m", block_m), ("block_n", block_n)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {n}")
    B, H, S, D = q.shape
    L = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = torch.empty_like(q)
    lse = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
    if debug:
        qh = torch.full((B, H, S, D), float("nan"), dtype=torch.float32, device=q.device)
        kh = torch.full((B, H, L, D), float("nan"), dtype=torch.float32, device=q.device)
        vh = torch.full_like(kh, float("nan"))
    else:
        qh = kh = vh = lse  # never written
    fp32 = q.dtype == torch.float32
    dot_ty = tl.float32 if fp32 else (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16)
    # The interpreter's 16-bit dots are wrong: it rounds to dot_ty, then multiplies in fp32.
    mma_ty = tl.float32 if os.environ.get("TRITON_INTERPRET") == "1" else dot_ty
    grid = (triton.cdiv(S, block_m), B * H)
    if S and L:
        attention_fwd_kernel[grid](
            q, k, v, out, lse, amaxes, qh, kh, vh, H, S, L, scale,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            D=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, DOT_TY=dot_ty, MMA_TY=mma_ty,
            PRECISION="ieee" if mma_ty == tl.float32 else None, SCALE_MAX=SCALE_MAX, DEBUG=debug,
            num_warps=4, **_launch_options(),
        )
    elif S:  # no keys at all: every row has nothing to attend to
        out.zero_()
        lse.fill_(float("inf"))
    return out, lse, (qh, kh, vh)


def fp4_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
    scale: float | None = None, *, q_amax=None, k_amax=None, v_amax=None,
    block_m: int = 64, block_n: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 attention forward of q [B, H, S, d] over k, v [B, H, L, d]: (out, lse).

    out has q's dtype; lse is the fp32 [B, H, S] log-sum-exp of the scaled scores. The amaxes
    are each tensor's global max |x| (float or 0-d tensor; None computes it here, as the
    reference does). causal: query i sees keys j <= i + L - S. scale defaults to 1/sqrt(d).
    """
    amaxes = _amaxes(q, k, v, q_amax, k_amax, v_amax)
    out, lse, _ = _launch(q, k, v, causal, scale, amaxes, block_m, block_n, debug=False)
    return out, lse


def quantized_operands(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, *,
    q_amax=None, k_amax=None, v_amax=None, block_m: int = 64, block_n: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For tests: the dequantized Q̂, K̂, V̂ (fp32) the forward kernel computed in its tiles.

    Key positions no program visited (causal skips tiles above the diagonal) stay NaN.
    """
    amaxes = _amaxes(q, k, v, q_amax, k_amax, v_amax)
    _, _, tiles = _launch(q, k, v, causal, None, amaxes, block_m, block_n, debug=True)
    return tiles
