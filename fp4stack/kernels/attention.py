"""Flash-attention-style Triton forward of NVFP4 attention (Q, K, V in NVFP4, P unquantized:
the default AttentionQuant and its ablations, whose forwards differ only in Q̂, K̂, V̂), matching
fp4stack.nn.attention.fp4_attention; the backward is in attention_bwd.py, the operands in
attention_units.py.

A prologue (attention_units.quantize_operands) quantizes Q, K along d and V along the keys once,
from the global amaxes, into units: E2M1 value times E4M3 block scale, exact in the input's
dtype; each tensor's global decode factor amax / (6 * 448) is a scalar applied to the fp32 dot
results. attention_fwd_kernel then takes BLOCK_M queries of one (batch, head), walks the keys
BLOCK_N at a time with an fp32 online softmax, and masks only the key tiles that need it
(key_range). The jit helpers here (key_range, score_factors, query_tile, key_tile_scores) are
the backward's too, so that both passes compute S and P alike, bit for bit.

Tiles: default_tiles (per head dim and dtype), TILE_OVERRIDES for sweeps. The design, the
backward's use of these units and the kernels' coverage: docs/attention.md; speeds in
docs/PERFORMANCE.md.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import cdiv, interpreted
from . import nvfp4_jit as jit
from .attention_common import E4M3_RANGE, Tile, check_tile
from .attention_units import quantize_operands, unit_values
from .nvfp4 import _launch_options

HEAD_DIMS = (16, 32, 64, 128)


def default_tiles(head_dim: int, device_type: str = "cuda",
                  dtype: torch.dtype = torch.bfloat16) -> dict[str, Tile]:
    """Tiles of each pass: "quant" (prologue; block_m rows), "fwd", "amax" and "dq" (query-major),
    "dkdv" (key-major). Under the interpreter: 16 x 16, so small tests cross tiles and tails.
    CUDA: chosen from ptxas's register reports for sm_90 and sweeps on an H200 (how, in
    docs/attention.md); fp32 inputs (tests) get small tiles, which take twice the shared memory.
    """
    if device_type != "cuda":
        t = Tile(16, 16, 1, 1)
        return dict(quant=t, fwd=t, amax=t, dkdv=t, dq=t)
    quant = Tile(max(16, 2048 // head_dim), 16, 2, 1)
    if dtype == torch.float32:
        t = Tile(64, 32, 4, 1)
        return dict(quant=quant, fwd=t, amax=t, dkdv=t, dq=t)
    big = head_dim > 64
    return dict(
        quant=quant,
        fwd=Tile(64, 64, 4, 3) if big else Tile(128, 64, 8, 2),
        amax=Tile(64, 64, 4, 2) if big else Tile(128, 64, 8, 2),
        dkdv=Tile(32, 64, 4, 2),
        dq=Tile(64, 32, 4, 2) if big else Tile(128, 64, 8, 2),
    )


def mma_type(dtype: torch.dtype):
    """(dot operand type, input_precision) for units of `dtype`."""
    if dtype == torch.float32 or interpreted():
        return tl.float32, "ieee"
    return (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16), None


@triton.jit
def key_range(pid_m, S, L, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(lo, hi) for query tile pid_m: key tiles below lo need no mask (every row of the tile may
    see every key there, all < L); tiles in [lo, hi) need one; keys past hi are seen by no row.
    Queries are the last S of L positions: query i sees keys j <= i + L - S."""
    hi = L
    lo = L
    if CAUSAL:
        hi = tl.minimum(L, (pid_m + 1) * BLOCK_M + L - S)
        lo = tl.minimum(L, pid_m * BLOCK_M + L - S + 1)
    return lo // BLOCK_N * BLOCK_N, hi


@triton.jit
def score_factors(amax_ptr, scale):
    """(q_dec, k_dec, qk_scale, v_dec) from the global amaxes [q, k, v]: each tensor's decode
    factor (jit.global_decode: amax / (6 * 448)), and the one applied to Q̂ K̂ᵀ dots with the
    softmax scale. Every kernel takes them from here, computed in one order, so the backward's
    P is the forward's bit for bit."""
    q_dec = jit.global_decode(tl.load(amax_ptr), E4M3_RANGE)
    k_dec = jit.global_decode(tl.load(amax_ptr + 1), E4M3_RANGE)
    qk_scale = q_dec * k_dec * scale
    v_dec = jit.global_decode(tl.load(amax_ptr + 2), E4M3_RANGE)
    return q_dec, k_dec, qk_scale, v_dec


@triton.jit
def query_tile(qu_ptr, bh, pid_m, S, D: tl.constexpr, BLOCK_M: tl.constexpr,
               MMA_TY: tl.constexpr):
    """(rows, row_ok, q_off, q): query tile pid_m of (batch, head) bh in the contiguous
    [B*H, S, D] layout, rows past S loaded as zeros; the forward and the backward read Q̂ here."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < S
    q_off = (bh.to(tl.int64) * S + rows[:, None]) * D + tl.arange(0, D)[None, :]
    q = tl.load(qu_ptr + q_off, mask=row_ok[:, None], other=0.0).to(MMA_TY)
    return rows, row_ok, q_off, q


@triton.jit
def key_tile_scores(q, ku_ptr, vu_ptr, kv_base, start_n, rows, S, L, qk_scale,
                    D: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                    CAUSAL: tl.constexpr, MMA_TY: tl.constexpr, PRECISION: tl.constexpr):
    """The K and V units of the key tile at start_n and the scaled scores of the query tile q
    against it: (keys, key_ok, k, v, s). MASK: keys past L load as zeros (the reference's
    padding of V's last 16-block) and s is -inf where a key is past L or causally hidden."""
    keys = start_n + tl.arange(0, BLOCK_N)
    key_ok = keys < L
    kv_off = kv_base + keys[:, None] * D + tl.arange(0, D)[None, :]
    if MASK:
        k = tl.load(ku_ptr + kv_off, mask=key_ok[:, None], other=0.0).to(MMA_TY)
        v = tl.load(vu_ptr + kv_off, mask=key_ok[:, None], other=0.0).to(MMA_TY)
    else:
        k = tl.load(ku_ptr + kv_off).to(MMA_TY)
        v = tl.load(vu_ptr + kv_off).to(MMA_TY)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASK:
        allowed = key_ok[None, :]
        if CAUSAL:
            allowed = allowed & (keys[None, :] <= rows[:, None] + (L - S))
        s = tl.where(allowed, s, float("-inf"))
    return keys, key_ok, k, v, s


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, ku_ptr, vu_ptr, kv_base, rows, lo, hi, S, L, qk_scale,
               D: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
               MMA_TY: tl.constexpr, PRECISION: tl.constexpr):
    """The online softmax over key tiles [lo, hi); MASK: apply the causal and key-count masks."""
    DOT_TY: tl.constexpr = ku_ptr.dtype.element_ty
    for start_n in range(lo, hi, BLOCK_N):
        _, _, _, v, s = key_tile_scores(q, ku_ptr, vu_ptr, kv_base, start_n, rows, S, L, qk_scale,
                                        D, BLOCK_N, MASK, CAUSAL, MMA_TY, PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no allowed key yet keeps max -inf: shift by 0 there, so exp gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # Accumulated in place (the dot adds into acc: no second accumulator); V's decode
        # factor, a scalar, is applied once at the end.
        acc = tl.dot(p.to(DOT_TY).to(MMA_TY), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attention_fwd_kernel(
    qu_ptr, ku_ptr, vu_ptr, o_ptr, lse_ptr, amax_ptr, S, L, G, scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    MMA_TY: tl.constexpr, PRECISION: tl.constexpr,
):
    """Output rows [BLOCK_M, D] (contiguous o [B*H, S, D]) and their log-sum-exp, from units.
    G query heads share a K/V head (grouped-query attention): K/V units are [B*H/G, L, D]."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    rows, row_ok, q_off, q = query_tile(qu_ptr, bh, pid_m, S, D, BLOCK_M, MMA_TY)
    _, _, qk_scale, v_dec = score_factors(amax_ptr, scale)
    kv_base = (bh // G).to(tl.int64) * L * D
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    lo, hi = key_range(pid_m, S, L, BLOCK_M, BLOCK_N, CAUSAL)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, ku_ptr, vu_ptr, kv_base, rows, 0, lo, S, L,
                               qk_scale, D, BLOCK_N, False, CAUSAL, MMA_TY, PRECISION)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, ku_ptr, vu_ptr, kv_base, rows, lo, hi, S, L,
                               qk_scale, D, BLOCK_N, True, CAUSAL, MMA_TY, PRECISION)

    # A row with no allowed key: output 0 and lse +inf, as the reference.
    has_key = l_i > 0
    out = (acc * v_dec) / tl.where(has_key, l_i, 1.0)[:, None]
    lse = tl.where(has_key, m_i + tl.log(l_i), float("inf"))
    tl.store(o_ptr + q_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + bh.to(tl.int64) * S + rows, lse, mask=row_ok)


def amaxes(q, k, v, q_amax=None, k_amax=None, v_amax=None) -> torch.Tensor:
    """The global amaxes of q, k, v as one fp32 [3] tensor on q's device (None: computed here,
    on the device, no host sync)."""
    out = []
    for t, a in ((q, q_amax), (k, k_amax), (v, v_amax)):
        # max |x| in one reduction (abs().amax() writes |x| out first)
        a = torch.linalg.vector_norm(t, float("inf")).float() if a is None else a
        out.append(torch.as_tensor(a, dtype=torch.float32, device=q.device).reshape(()))
    return torch.stack(out)


def check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"need q [B, H, S, d] and k, v [B, H, L, d], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[1] % max(k.shape[1], 1):
        raise ValueError("q, k, v must share batch and head_dim, and k/v heads must divide q heads")
    if q.shape[3] not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {q.shape[3]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"q, k, v must be float32, bfloat16 or float16, got {q.dtype}")
    if causal and q.shape[2] > k.shape[2]:
        raise ValueError(f"causal attention needs S <= L, got S={q.shape[2]}, L={k.shape[2]}")


# Process-wide overrides of default_tiles, {pass: Tile}: for benchmarks/bench_attention.py --sweep.
TILE_OVERRIDES: dict[str, Tile] = {}


def tiles_for(q: torch.Tensor, tiles: dict[str, Tile] | None) -> dict[str, Tile]:
    """default_tiles for q, then TILE_OVERRIDES, then `tiles`, checked."""
    out = default_tiles(q.shape[-1], q.device.type, q.dtype)
    out.update(TILE_OVERRIDES)
    out.update(tiles or {})
    for t in out.values():
        check_tile(t)
    return out


def forward_units(qu, ku, vu, amax, causal: bool, scale: float, tile: Tile):
    """(out, lse) from the units of quantize_operands; out is contiguous, in the units' dtype."""
    B, H, S, D = qu.shape
    L = ku.shape[2]
    out = torch.empty_like(qu)
    lse = torch.empty((B, H, S), dtype=torch.float32, device=qu.device)
    mma_ty, precision = mma_type(qu.dtype)
    if S and L:
        attention_fwd_kernel[(cdiv(S, tile.block_m), B * H)](
            qu, ku, vu, out, lse, amax, S, L, H // ku.shape[1], scale, D=D, BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n, CAUSAL=causal, MMA_TY=mma_ty, PRECISION=precision,
            num_warps=tile.num_warps, num_stages=tile.num_stages, **_launch_options())
    elif S:  # no keys at all: every row has nothing to attend to
        out.zero_()
        lse.fill_(float("inf"))
    return out, lse


def fp4_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
    scale: float | None = None, *, q_amax=None, k_amax=None, v_amax=None,
    tiles: dict[str, Tile] | None = None, tiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 attention forward of q [B, H, S, d] over k, v [B, Hkv, L, d]: (out, lse); query
    head h reads K/V head h // (H / Hkv). tiled: Q, K, V in 16x16 tiles (NVFP4_TILES).

    out has q's dtype; lse is the fp32 [B, H, S] log-sum-exp of the scaled scores. The amaxes
    are each tensor's global max |x| (float or 0-d tensor; None computes it here, as the
    reference does). causal: query i sees keys j <= i + L - S. scale defaults to 1/sqrt(d).
    tiles overrides entries of default_tiles.
    """
    check(q, k, v, causal)
    tiles = tiles_for(q, tiles)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    amax = amaxes(q, k, v, q_amax, k_amax, v_amax)
    units = quantize_operands(q, k, v, amax, tiles["quant"], tiled)
    return forward_units(*units, amax, causal, scale, tiles["fwd"])


def quantized_operands(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_amax=None, k_amax=None,
    v_amax=None, tiles: dict[str, Tile] | None = None, tiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For tests: the dequantized Q̂, K̂, V̂ (fp32) the kernels use: the prologue's units times
    the global decode factor, multiplied as the quantize kernels do; `tiled`: 16x16 tiles."""
    check(q, k, v, False)
    tiles = tiles_for(q, tiles)
    amax = amaxes(q, k, v, q_amax, k_amax, v_amax)
    units = quantize_operands(q, k, v, amax, tiles["quant"], tiled)
    return tuple(unit_values(u, amax, i) for i, u in enumerate(units))
