"""Flash-attention-style Triton backward of NVFP4 attention (the default AttentionQuant: the
forward's Q̂, K̂, V̂ reused, dS in NVFP4 1x16 RNE, P and dO high precision), matching the
backward of fp4stack.nn.attention.fp4_attention.

The reference quantizes dS with one global amax over the whole [B, H, S, L] dS, so dS is made
twice: once to find that amax, once to use it. Passes, all reading the units of attention.py's
prologue (E2M1 x E4M3 values, exact in bf16) and applying the scalar global factors to fp32 dots:

1. delta_kernel: delta = rowsum(dO ∘ O), fp32, from the output as returned (bf16 for bf16
   inputs, as flash attention does; the reference keeps an fp32 O).
2. query_kernel with DQ=False (query-major: BLOCK_M queries, loop over key tiles): recomputes
   S = Q̂ K̂ᵀ, P = exp(S - lse) with the forward's lse, dP = dO V̂ᵀ, dS = P ∘ (dP - delta), and
   writes each program's max |dS|; their max is the global amax (on the device, no host sync).
   Like the forward, it masks only the key tiles that need it (attention.key_range).
3. dkdv_kernel (key-major: BLOCK_N keys, loop over query tiles, tiles transposed so that Pᵀ and
   dSᵀ come straight out of the dots): dV += Pᵀ dO; dSᵀ quantized in 16-blocks along the queries,
   dK += dŜᵀ Q̂. With ATOMIC_DQ (the default) it also quantizes dSᵀ along the keys and adds
   dŜ K̂ into an fp32 dQ with atomics (summation order then varies from run to run).
4. deterministic=True (or DETERMINISTIC) instead: dkdv_kernel without atomics, then
   query_kernel with DQ=True quantizes dS along the keys and sums dQ = dŜ K̂ over the key tiles
   itself; results are then the same from run to run.

GQA: query head h reads K/V head h // G (G = H / Hkv) in every kernel; a dkdv program takes one
K/V head's key tile and loops over its G query heads, so dK and dV sum over them in fp32.

Dots: 2 (amax) + 5 (dkdv with atomic dQ) = 7; deterministic: 2 + 4 + 3 = 9; FlashAttention-2's
backward does 5. Tiles start at multiples of their size (>= 16), so the 16-blocks of dS are the
reference's (which zero-pads the queries or keys); padded and masked entries have P = 0 and
dS = 0. Causal: queries are the last S of L positions (query i sees keys j <= i + L - S), and
tiles that see nothing are skipped. dQ, dK, dV are accumulated in fp32, stored in the input dtype.

Measured only on a CPU under the Triton interpreter (see tests/test_attention_kernel.py for the
errors against the reference); compiles for sm_90; speed unmeasured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import (
    INV_RANGE,
    SCALE_MAX,
    Tile,
    key_range,
    key_tile_scores,
    mma_type,
    quantize_tile,
)
from .nvfp4 import _launch_options

# The default of backward_units and of fp4_attention's Triton path: False sums dQ with atomics.
DETERMINISTIC = False


@triton.jit
def delta_kernel(o_ptr, do_ptr, delta_ptr, R, D: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < R
    off = rows[:, None].to(tl.int64) * D + tl.arange(0, D)[None, :]
    o = tl.load(o_ptr + off, mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptr + off, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(delta_ptr + rows, tl.sum(o * do, 1), mask=ok)


@triton.jit
def _query_tiles(m, acc, q, do, lse, delta, ku_ptr, vu_ptr, dbg_ptr, kv_base, bh, rows, lo, hi,
                 BH, S, L, qk_scale, v_dec, ds_amax, D: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASK: tl.constexpr, CAUSAL: tl.constexpr, DQ: tl.constexpr,
                 MMA_TY: tl.constexpr, PRECISION: tl.constexpr, SCALE_MAX: tl.constexpr,
                 DEBUG: tl.constexpr):
    """query_kernel's loop over key tiles [lo, hi); MASK: apply the causal and key-count masks."""
    for start_n in range(lo, hi, BLOCK_N):
        keys, key_ok, k, v, s = key_tile_scores(q, ku_ptr, vu_ptr, kv_base, start_n, rows, S, L,
                                                qk_scale, D, BLOCK_N, MASK, CAUSAL, MMA_TY,
                                                PRECISION)
        p = tl.exp(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION) * v_dec
        ds = p * (dp - delta[:, None])
        if DQ:
            units, _ = quantize_tile(ds, ds_amax, 1, SCALE_MAX)
            acc += tl.dot(units.to(k.dtype), k, input_precision=PRECISION)
            if DEBUG:
                off = (bh.to(tl.int64) * S + rows[:, None]) * L + keys[None, :]
                ok = (rows < S)[:, None] & key_ok[None, :]
                tl.store(dbg_ptr + 2 * BH * S * L + off, ds, mask=ok)
                tl.store(dbg_ptr + 3 * BH * S * L + off, units * (ds_amax * INV_RANGE), mask=ok)
        else:
            m = tl.maximum(m, tl.reduce(tl.abs(ds), 1, _max_nan))
    return m, acc


@triton.jit
def query_kernel(
    qu_ptr, ku_ptr, vu_ptr, do_ptr, lse_ptr, delta_ptr, amax_ptr, partial_ptr, dq_ptr, dbg_ptr,
    BH, S, L, G, scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    DQ: tl.constexpr, MMA_TY: tl.constexpr, PRECISION: tl.constexpr, SCALE_MAX: tl.constexpr,
    DEBUG: tl.constexpr,
):
    """BLOCK_M query rows against every key tile they see. DQ=False: the rows' max |dS| into
    partial[program]. DQ=True: dQ rows from dS quantized along the keys (amax_ptr[3]); DEBUG also
    writes the raw dS to dbg[2] and the dequantized dŜ to dbg[3] ([4, B*H, S, L] fp32)."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, D)
    row_ok = rows < S
    q_off = (bh.to(tl.int64) * S + rows[:, None]) * D + cols[None, :]
    q = tl.load(qu_ptr + q_off, mask=row_ok[:, None], other=0.0).to(MMA_TY)
    do = tl.load(do_ptr + q_off, mask=row_ok[:, None], other=0.0).to(MMA_TY)
    # Padded rows: lse +inf gives P = 0 there, hence dS = 0.
    lse = tl.load(lse_ptr + bh.to(tl.int64) * S + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(delta_ptr + bh.to(tl.int64) * S + rows, mask=row_ok, other=0.0)
    k_dec = tl.load(amax_ptr + 1) * INV_RANGE
    qk_scale = tl.load(amax_ptr) * INV_RANGE * k_dec * scale
    v_dec = tl.load(amax_ptr + 2) * INV_RANGE
    ds_amax = tl.load(amax_ptr + 3)
    kv_base = (bh // G).to(tl.int64) * L * D  # G query heads per K/V head
    m = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    lo, hi = key_range(pid_m, S, L, BLOCK_M, BLOCK_N, CAUSAL)
    # Key tiles [0, lo) need no mask, [lo, hi) do.
    m, acc = _query_tiles(m, acc, q, do, lse, delta, ku_ptr, vu_ptr, dbg_ptr, kv_base, bh, rows,
                          0, lo, BH, S, L, qk_scale, v_dec, ds_amax, D, BLOCK_N, False, CAUSAL,
                          DQ, MMA_TY, PRECISION, SCALE_MAX, DEBUG)
    m, acc = _query_tiles(m, acc, q, do, lse, delta, ku_ptr, vu_ptr, dbg_ptr, kv_base, bh, rows,
                          lo, hi, BH, S, L, qk_scale, v_dec, ds_amax, D, BLOCK_N, True, CAUSAL,
                          DQ, MMA_TY, PRECISION, SCALE_MAX, DEBUG)
    if DQ:
        dq = acc * (ds_amax * INV_RANGE * k_dec * scale)
        tl.store(dq_ptr + q_off, dq.to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(partial_ptr + bh.to(tl.int64) * tl.num_programs(0) + pid_m,
                 tl.reduce(m, 0, _max_nan))


@triton.jit
def _max_nan(a, b):  # a NaN dS makes the amax NaN, as torch's amax does
    return tl.where((a > b) | (a != a), a, b)


@triton.jit
def dkdv_kernel(
    qu_ptr, ku_ptr, vu_ptr, do_ptr, lse_ptr, delta_ptr, amax_ptr, dk_ptr, dv_ptr, dq_ptr,
    dbg_ptr, BH, S, L, G, scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, MMA_TY: tl.constexpr, PRECISION: tl.constexpr,
    SCALE_MAX: tl.constexpr, DEBUG: tl.constexpr,
):
    """dK, dV rows of BLOCK_N keys of one K/V head from every query tile of its G query heads
    that sees them, in transposed tiles [keys, queries]; the sum over the heads stays in fp32.
    ATOMIC_DQ: also dQ (fp32, unscaled: the caller multiplies by the global factors) by atomic
    adds. DEBUG writes raw dSᵀ to dbg[0] and dŜ along queries to dbg[1]
    (and with ATOMIC_DQ dbg[2], dbg[3] as query_kernel does)."""
    pid_n, kvh = tl.program_id(0), tl.program_id(1)
    DOT_TY: tl.constexpr = qu_ptr.dtype.element_ty
    keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, D)
    key_ok = keys < L
    kv_off = (kvh.to(tl.int64) * L + keys[:, None]) * D + cols[None, :]
    k = tl.load(ku_ptr + kv_off, mask=key_ok[:, None], other=0.0).to(MMA_TY)
    v = tl.load(vu_ptr + kv_off, mask=key_ok[:, None], other=0.0).to(MMA_TY)
    q_dec = tl.load(amax_ptr) * INV_RANGE
    qk_scale = q_dec * (tl.load(amax_ptr + 1) * INV_RANGE) * scale
    v_dec = tl.load(amax_ptr + 2) * INV_RANGE
    ds_amax = tl.load(amax_ptr + 3)
    ds_dec = ds_amax * INV_RANGE
    dk = tl.zeros((BLOCK_N, D), tl.float32)
    dv = tl.zeros((BLOCK_N, D), tl.float32)
    lo = 0
    if CAUSAL:  # the first query that sees key pid_n * BLOCK_N is that key - (L - S)
        lo = tl.maximum(pid_n * BLOCK_N - (L - S), 0) // BLOCK_M * BLOCK_M
    for g in range(G):
        q_base = (kvh * G + g).to(tl.int64) * S
        for start_m in range(lo, S, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            row_ok = rows < S
            q_off = (q_base + rows[:, None]) * D + cols[None, :]
            q = tl.load(qu_ptr + q_off, mask=row_ok[:, None], other=0.0).to(MMA_TY)
            do = tl.load(do_ptr + q_off, mask=row_ok[:, None], other=0.0).to(MMA_TY)
            lse = tl.load(lse_ptr + q_base + rows, mask=row_ok, other=float("inf"))
            delta = tl.load(delta_ptr + q_base + rows, mask=row_ok, other=0.0)
            st = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
            allowed = key_ok[:, None]
            if CAUSAL:
                allowed = allowed & (keys[:, None] <= rows[None, :] + (L - S))
            pt = tl.exp(tl.where(allowed, st, float("-inf")) - lse[None, :])
            dv += tl.dot(pt.to(DOT_TY).to(MMA_TY), do, input_precision=PRECISION)
            dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION) * v_dec
            dst = pt * (dpt - delta[None, :])
            units, _ = quantize_tile(dst, ds_amax, 1, SCALE_MAX)  # 16-blocks along the queries
            dk += tl.dot(units.to(q.dtype), q, input_precision=PRECISION)
            if ATOMIC_DQ:
                units_k, _ = quantize_tile(dst, ds_amax, 0, SCALE_MAX)  # along the keys
                dq = tl.dot(tl.trans(units_k.to(k.dtype)), k, input_precision=PRECISION)
                tl.atomic_add(dq_ptr + q_off, dq, mask=row_ok[:, None], sem="relaxed")
            if DEBUG:
                off = (q_base + rows[None, :]) * L + keys[:, None]
                ok = row_ok[None, :] & key_ok[:, None]
                tl.store(dbg_ptr + off, dst, mask=ok)
                tl.store(dbg_ptr + BH * S * L + off, units * ds_dec, mask=ok)
                if ATOMIC_DQ:
                    tl.store(dbg_ptr + 2 * BH * S * L + off, dst, mask=ok)
                    tl.store(dbg_ptr + 3 * BH * S * L + off, units_k * ds_dec, mask=ok)
    dk = dk * (ds_dec * q_dec * scale)
    tl.store(dk_ptr + kv_off, dk.to(dk_ptr.dtype.element_ty), mask=key_ok[:, None])
    tl.store(dv_ptr + kv_off, dv.to(dv_ptr.dtype.element_ty), mask=key_ok[:, None])


def backward_units(do, qu, ku, vu, out, lse, amax, causal: bool, scale: float,
                   tiles: dict[str, Tile], deterministic: bool | None = None,
                   debug: bool = False):
    """(dq, dk, dv, ds_amax, dbg) for the units, output and lse of attention.forward_units.

    do [B, H, S, d] is made contiguous. ds_amax is the 0-d global amax of dS. dbg (debug=True,
    else None) is [4, B, H, S, L] fp32: the raw dS the dK pass quantized, dŜ along queries, the
    raw dS the dQ pass quantized, dŜ along keys; tiles no program visited stay NaN.
    deterministic: a dQ pass of its own instead of atomic adds (None: DETERMINISTIC).
    """
    deterministic = DETERMINISTIC if deterministic is None else deterministic
    B, H, S, D = qu.shape
    Hkv, L = ku.shape[1], ku.shape[2]
    G = H // Hkv
    dev = qu.device
    do = do.contiguous()
    dk, dv = torch.zeros_like(ku), torch.zeros_like(vu)
    if not (S and L):
        return torch.zeros_like(qu), dk, dv, torch.zeros((), device=dev), None
    opts = _launch_options()
    mma_ty, precision = mma_type(qu.dtype)
    common = dict(D=D, CAUSAL=causal, MMA_TY=mma_ty, PRECISION=precision)
    delta = torch.empty((B, H, S), dtype=torch.float32, device=dev)
    delta_kernel[(triton.cdiv(B * H * S, 64),)](out, do, delta, B * H * S, D=D, BLOCK=64,
                                                 **opts)
    t = tiles["amax"]
    grid = (triton.cdiv(S, t.block_m), B * H)
    partial = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=dev)
    amax4 = torch.cat([amax, amax[:1]])  # slot 3 (dS) unused by the amax pass
    query_kernel[grid](qu, ku, vu, do, lse, delta, amax4, partial, partial, partial,
                       B * H, S, L, G, scale, BLOCK_M=t.block_m, BLOCK_N=t.block_n, DQ=False,
                       SCALE_MAX=SCALE_MAX, DEBUG=False, **common, num_warps=t.num_warps,
                       num_stages=t.num_stages, **opts)
    ds_amax = partial.amax()
    amax4 = torch.cat([amax, ds_amax.reshape(1)])
    dbg = torch.full((4, B, H, S, L), float("nan"), device=dev) if debug else partial
    dq_acc = torch.zeros((B, H, S, D), dtype=torch.float32, device=dev) if not deterministic \
        else partial
    t = tiles["dkdv"]
    dkdv_kernel[(triton.cdiv(L, t.block_n), B * Hkv)](
        qu, ku, vu, do, lse, delta, amax4, dk, dv, dq_acc, dbg, B * H, S, L, G, scale,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, ATOMIC_DQ=not deterministic, SCALE_MAX=SCALE_MAX,
        DEBUG=debug, **common, num_warps=t.num_warps, num_stages=t.num_stages, **opts)
    if deterministic:
        dq = torch.empty_like(qu)
        t = tiles["dq"]
        query_kernel[(triton.cdiv(S, t.block_m), B * H)](
            qu, ku, vu, do, lse, delta, amax4, partial, dq, dbg, B * H, S, L, G, scale,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, DQ=True, SCALE_MAX=SCALE_MAX, DEBUG=debug,
            **common, num_warps=t.num_warps, num_stages=t.num_stages, **opts)
    else:  # the global factors, as query_kernel applies them
        factor = ds_amax * (1.0 / (SCALE_MAX * 6.0)) * (amax[1] * (1.0 / (SCALE_MAX * 6.0)))
        dq = (dq_acc * (factor * scale)).to(qu.dtype)
    return dq, dk, dv, ds_amax, (dbg if debug else None)
