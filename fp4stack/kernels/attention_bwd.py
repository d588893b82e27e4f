"""Flash-attention-style Triton backward of NVFP4 attention, matching the backward of
fp4stack.nn.attention.fp4_attention: by default the forward's Q̂, K̂, V̂ reused, dS in NVFP4 1x16
RNE, P and dO high precision; also the ablations, through its operands and two switches.

backward_units takes its GEMM operands explicitly, as units (attention_units.py): qu, ku for
S = Q̂ K̂ᵀ, vu for dP = dO V̂ᵀ, and optionally q_dk for dK = dŜᵀ Q̂ and k_dq for dQ = dŜ K̂ (none:
constexpr REUSE, the kernels read qu and ku there). quant_ds=False (ds=None, constexpr QUANT_DS)
feeds the raw dS to the dK and dQ dots; delta_dp (delta="dp", constexpr DELTA_DP) takes
delta = rowsum(P ∘ dP) instead of rowsum(dO ∘ O). Under the defaults the extra pointers are
never read and the kernels compile as if the ablations did not exist.

Passes, each reading units and applying the scalar global decode factors to fp32 dots:
1. query_kernel, DQ=False (query-major): delta of its rows, then S, P = exp(S - lse), dP and dS
   tile by tile, for each program's max |dS| (dS's global amax, on the device); without dS
   quantization (and delta "output"), delta_kernel computes delta alone.
2. dkdv_kernel (key-major, transposed tiles): dV += Pᵀ dO and dK += dŜᵀ Q̂ with dS quantized
   along the queries; with ATOMIC_DQ also dQ, by atomic adds.
3. query_kernel, DQ=True (DETERMINISTIC, the default): dQ = dŜ K̂ with dS quantized along the
   keys, summed in a fixed order.

Grouped-query attention: query head h reads K/V head h // G; a dkdv program loops over the G
query heads of its K/V head. dQ, dK, dV accumulate in fp32. Design, dot counts and the
tolerances: docs/attention.md; speeds in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.global_scale import global_decode_scale
from . import cdiv
from . import nvfp4_jit as jit
from .attention import key_range, key_tile_scores, mma_type, query_tile, score_factors
from .attention_common import E4M3_RANGE, SCALE_MAX, Tile
from .attention_units import quantize_tile
from .nvfp4 import _launch_options

# The default of backward_units and of fp4_attention's Triton path: True computes dQ in a pass
# of its own, False adds it from the key-major pass with atomics. The separate pass gives the
# same bits every run and was faster on an H200 (docs/attention.md).
DETERMINISTIC = True


@triton.jit
def _delta(o_ptr, do, off, ok):
    """delta = rowsum(dO ∘ O) in fp32 of rows of dO (do, as loaded) and of O (at o_ptr + off)."""
    o = tl.load(o_ptr + off, mask=ok[:, None], other=0.0).to(tl.float32)
    return tl.sum(o * do.to(tl.float32), 1)


@triton.jit
def delta_kernel(o_ptr, do_ptr, delta_ptr, R, D: tl.constexpr, BLOCK: tl.constexpr):
    """delta without the amax pass (ds=None), which otherwise computes it."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < R
    off = rows[:, None].to(tl.int64) * D + tl.arange(0, D)[None, :]
    do = tl.load(do_ptr + off, mask=ok[:, None], other=0.0)
    tl.store(delta_ptr + rows, _delta(o_ptr, do, off, ok), mask=ok)


@triton.jit
def ds_factors(amax_ptr, QUANT_DS: tl.constexpr):
    """(ds_amax, ds_dec) from amax_ptr[3]: dS's global amax and the decode factor of its
    quantized operand; ds=None (not QUANT_DS): the raw dS is its own value, factor 1."""
    ds_amax = tl.load(amax_ptr + 3)
    # A constexpr if statement (not a ternary): what every Triton version resolves at compile
    # time, so the default config's kernels are unchanged.
    if QUANT_DS:  # noqa: SIM108
        ds_dec = jit.global_decode(ds_amax, E4M3_RANGE)
    else:
        ds_dec = 1.0
    return ds_amax, ds_dec


@triton.jit
def ds_operand(ds, ds_amax, AXIS: tl.constexpr, QUANT_DS: tl.constexpr, DOT_TY: tl.constexpr,
               MMA_TY: tl.constexpr, SCALE_MAX: tl.constexpr):
    """dS as an operand of the dQ or dK dot. QUANT_DS: its NVFP4 units in 16-blocks along AXIS
    (the dot's result times ds_amax / 2688 is dŜ's product). Else (ds=None) the raw dS rounded to
    the dot dtype, as P is for dV: exact for fp32 inputs, bf16/fp16 rounding for 16-bit ones."""
    if QUANT_DS:
        x, _ = quantize_tile(ds, ds_amax, AXIS, SCALE_MAX, ds, False)
    else:
        x = ds.to(DOT_TY)
    return x.to(MMA_TY)


@triton.jit
def _query_tiles(m, acc, q, do, lse, delta, ku_ptr, k_dq_ptr, v_dp_ptr, dbg_ptr, kv_base, bh,
                 rows, lo, hi, BH, S, L, qk_scale, v_dec, ds_amax, ds_dec, D: tl.constexpr,
                 BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
                 DQ: tl.constexpr, REUSE: tl.constexpr, QUANT_DS: tl.constexpr,
                 MMA_TY: tl.constexpr, PRECISION: tl.constexpr, SCALE_MAX: tl.constexpr,
                 DEBUG: tl.constexpr, DELTA: tl.constexpr):
    """query_kernel's loop over key tiles [lo, hi); MASK: apply the causal and key-count masks.
    DELTA: add the rows' rowsum(P ∘ dP) into m instead (delta="dp", before delta is known)."""
    DOT_TY: tl.constexpr = ku_ptr.dtype.element_ty
    for start_n in range(lo, hi, BLOCK_N):
        keys, key_ok, k, v, s = key_tile_scores(q, ku_ptr, v_dp_ptr, kv_base, start_n, rows, S,
                                                L, qk_scale, D, BLOCK_N, MASK, CAUSAL, MMA_TY,
                                                PRECISION)
        p = tl.exp(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION) * v_dec
        if DELTA:
            m += tl.sum(p * dp, 1)
        else:
            ds = p * (dp - delta[:, None])
            if DQ:
                k_dq = k
                if not REUSE:  # K̂ with blocks along the keys; rows past L load as zeros, as K̂ does
                    kv_off = kv_base + keys[:, None] * D + tl.arange(0, D)[None, :]
                    k_dq = tl.load(k_dq_ptr + kv_off, mask=key_ok[:, None], other=0.0).to(MMA_TY)
                x = ds_operand(ds, ds_amax, 1, QUANT_DS, DOT_TY, MMA_TY, SCALE_MAX)  # along keys
                acc += tl.dot(x, k_dq, input_precision=PRECISION)
                if DEBUG:
                    off = (bh.to(tl.int64) * S + rows[:, None]) * L + keys[None, :]
                    ok = (rows < S)[:, None] & key_ok[None, :]
                    tl.store(dbg_ptr + 2 * BH * S * L + off, ds, mask=ok)
                    tl.store(dbg_ptr + 3 * BH * S * L + off, x.to(tl.float32) * ds_dec, mask=ok)
            else:
                m = jit.max_nan(m, jit.abs_max(ds, 1))
    return m, acc


@triton.jit
def _key_sweep(m, acc, q, do, lse, delta, ku_ptr, k_dq_ptr, v_dp_ptr, dbg_ptr, kv_base, bh,
               rows, lo, hi, BH, S, L, qk_scale, v_dec, ds_amax, ds_dec, D: tl.constexpr,
               BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DQ: tl.constexpr,
               REUSE: tl.constexpr, QUANT_DS: tl.constexpr, MMA_TY: tl.constexpr,
               PRECISION: tl.constexpr, SCALE_MAX: tl.constexpr, DEBUG: tl.constexpr,
               DELTA: tl.constexpr):
    """_query_tiles over every key tile the rows see: [0, lo) need no mask, [lo, hi) do."""
    m, acc = _query_tiles(m, acc, q, do, lse, delta, ku_ptr, k_dq_ptr, v_dp_ptr, dbg_ptr,
                          kv_base, bh, rows, 0, lo, BH, S, L, qk_scale, v_dec, ds_amax, ds_dec,
                          D, BLOCK_N, False, CAUSAL, DQ, REUSE, QUANT_DS, MMA_TY, PRECISION,
                          SCALE_MAX, DEBUG, DELTA)
    return _query_tiles(m, acc, q, do, lse, delta, ku_ptr, k_dq_ptr, v_dp_ptr, dbg_ptr,
                        kv_base, bh, rows, lo, hi, BH, S, L, qk_scale, v_dec, ds_amax, ds_dec,
                        D, BLOCK_N, True, CAUSAL, DQ, REUSE, QUANT_DS, MMA_TY, PRECISION,
                        SCALE_MAX, DEBUG, DELTA)


@triton.jit
def query_kernel(
    qu_ptr, ku_ptr, k_dq_ptr, v_dp_ptr, do_ptr, o_ptr, lse_ptr, delta_ptr, amax_ptr,
    partial_ptr, dq_ptr, dbg_ptr, BH, S, L, G, scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    DQ: tl.constexpr, REUSE: tl.constexpr, QUANT_DS: tl.constexpr, MMA_TY: tl.constexpr,
    PRECISION: tl.constexpr, SCALE_MAX: tl.constexpr, DEBUG: tl.constexpr,
    DELTA_DP: tl.constexpr = False,
):
    """BLOCK_M query rows against every key tile they see: S from the units qu, ku (blocks along
    d), dP from v_dp. DQ=False: first the rows' delta = rowsum(dO ∘ O) from o into delta (the
    later passes read it there; DELTA_DP: rowsum(P ∘ dP), from a sweep of its own over the key
    tiles), then, if QUANT_DS, the rows' max |dS| into partial[program]. DQ=True: dQ
    rows from dS (quantized along the keys with amax_ptr[3] if QUANT_DS) times the K units
    k_dq (REUSE: ku itself, k_dq_ptr unused); DEBUG also writes the raw dS to dbg[2] and the
    dS operand's values to dbg[3] ([4, B*H, S, L] fp32)."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    rows, row_ok, q_off, q = query_tile(qu_ptr, bh, pid_m, S, D, BLOCK_M, MMA_TY)
    do = tl.load(do_ptr + q_off, mask=row_ok[:, None], other=0.0)
    # Padded rows: lse +inf gives P = 0 there, hence dS = 0.
    lse = tl.load(lse_ptr + bh.to(tl.int64) * S + rows, mask=row_ok, other=float("inf"))
    if DQ:
        delta = tl.load(delta_ptr + bh.to(tl.int64) * S + rows, mask=row_ok, other=0.0)
    elif not DELTA_DP:
        delta = _delta(o_ptr, do, q_off, row_ok)
        tl.store(delta_ptr + bh.to(tl.int64) * S + rows, delta, mask=row_ok)
    do = do.to(MMA_TY)
    _, k_dec, qk_scale, v_dec = score_factors(amax_ptr, scale)
    ds_amax, ds_dec = ds_factors(amax_ptr, QUANT_DS)
    kv_base = (bh // G).to(tl.int64) * L * D  # G query heads per K/V head
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    lo, hi = key_range(pid_m, S, L, BLOCK_M, BLOCK_N, CAUSAL)
    if DELTA_DP and not DQ:
        delta = tl.zeros((BLOCK_M,), tl.float32)
        delta, acc = _key_sweep(delta, acc, q, do, lse, delta, ku_ptr, k_dq_ptr, v_dp_ptr,
                                dbg_ptr, kv_base, bh, rows, lo, hi, BH, S, L, qk_scale, v_dec,
                                ds_amax, ds_dec, D, BLOCK_N, CAUSAL, DQ, REUSE, QUANT_DS,
                                MMA_TY, PRECISION, SCALE_MAX, DEBUG, True)
        tl.store(delta_ptr + bh.to(tl.int64) * S + rows, delta, mask=row_ok)
    m = tl.zeros((BLOCK_M,), tl.float32)
    if DQ or QUANT_DS:
        m, acc = _key_sweep(m, acc, q, do, lse, delta, ku_ptr, k_dq_ptr, v_dp_ptr, dbg_ptr,
                            kv_base, bh, rows, lo, hi, BH, S, L, qk_scale, v_dec, ds_amax,
                            ds_dec, D, BLOCK_N, CAUSAL, DQ, REUSE, QUANT_DS, MMA_TY, PRECISION,
                            SCALE_MAX, DEBUG, False)
    if DQ:
        dq = acc * (ds_dec * k_dec * scale)
        tl.store(dq_ptr + q_off, dq.to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])
    elif QUANT_DS:
        tl.store(partial_ptr + bh.to(tl.int64) * tl.num_programs(0) + pid_m,
                 jit.abs_max(m, 0))


@triton.jit
def dkdv_kernel(
    qu_ptr, ku_ptr, q_dk_ptr, k_dq_ptr, v_dp_ptr, do_ptr, lse_ptr, delta_ptr, amax_ptr, dk_ptr,
    dv_ptr, dq_ptr, dbg_ptr, BH, S, L, G, scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, REUSE: tl.constexpr, QUANT_DS: tl.constexpr,
    MMA_TY: tl.constexpr, PRECISION: tl.constexpr, SCALE_MAX: tl.constexpr,
    DEBUG: tl.constexpr,
):
    """dK, dV rows of BLOCK_N keys of one K/V head from every query tile of its G query heads
    that sees them, in transposed tiles [keys, queries]; the sum over the heads stays in fp32.
    S from qu, ku (blocks along d), dP from v_dp, dK = dSᵀ q_dk; ATOMIC_DQ: also dQ = dS k_dq
    (fp32, unscaled: the caller multiplies by the global factors) by atomic adds. REUSE: q_dk and
    k_dq are qu and ku (their pointers unused). QUANT_DS: dS quantized with amax_ptr[3] (along
    the queries for dK, the keys for dQ), else raw (ds_operand). DEBUG writes raw dSᵀ to dbg[0]
    and the dK dot's dS operand to dbg[1] (and with ATOMIC_DQ dbg[2], dbg[3] as query_kernel)."""
    pid_n, kvh = tl.program_id(0), tl.program_id(1)
    DOT_TY: tl.constexpr = qu_ptr.dtype.element_ty
    keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, D)
    key_ok = keys < L
    kv_off = (kvh.to(tl.int64) * L + keys[:, None]) * D + cols[None, :]
    k = tl.load(ku_ptr + kv_off, mask=key_ok[:, None], other=0.0).to(MMA_TY)
    v = tl.load(v_dp_ptr + kv_off, mask=key_ok[:, None], other=0.0).to(MMA_TY)
    k_dq = k
    if ATOMIC_DQ:  # noqa: SIM102 (constexpr ifs, see ds_factors)
        if not REUSE:  # K̂ with blocks along the keys (dQ's reduction dim)
            k_dq = tl.load(k_dq_ptr + kv_off, mask=key_ok[:, None], other=0.0).to(MMA_TY)
    q_dec, _, qk_scale, v_dec = score_factors(amax_ptr, scale)
    ds_amax, ds_dec = ds_factors(amax_ptr, QUANT_DS)
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
            q_dk = q
            if not REUSE:  # Q̂ with blocks along the queries (dK's reduction dim)
                q_dk = tl.load(q_dk_ptr + q_off, mask=row_ok[:, None], other=0.0).to(MMA_TY)
            x = ds_operand(dst, ds_amax, 1, QUANT_DS, DOT_TY, MMA_TY, SCALE_MAX)  # along queries
            dk += tl.dot(x, q_dk, input_precision=PRECISION)
            if ATOMIC_DQ:
                x_k = ds_operand(dst, ds_amax, 0, QUANT_DS, DOT_TY, MMA_TY, SCALE_MAX)  # keys
                dq = tl.dot(tl.trans(x_k), k_dq, input_precision=PRECISION)
                tl.atomic_add(dq_ptr + q_off, dq, mask=row_ok[:, None], sem="relaxed")
            if DEBUG:
                off = (q_base + rows[None, :]) * L + keys[:, None]
                ok = row_ok[None, :] & key_ok[:, None]
                tl.store(dbg_ptr + off, dst, mask=ok)
                tl.store(dbg_ptr + BH * S * L + off, x.to(tl.float32) * ds_dec, mask=ok)
                if ATOMIC_DQ:
                    tl.store(dbg_ptr + 2 * BH * S * L + off, dst, mask=ok)
                    tl.store(dbg_ptr + 3 * BH * S * L + off, x_k.to(tl.float32) * ds_dec,
                             mask=ok)
    dk = dk * (ds_dec * q_dec * scale)
    tl.store(dk_ptr + kv_off, dk.to(dk_ptr.dtype.element_ty), mask=key_ok[:, None])
    tl.store(dv_ptr + kv_off, dv.to(dv_ptr.dtype.element_ty), mask=key_ok[:, None])


def backward_units(do, qu, ku, vu, out, lse, amax, causal: bool, scale: float,
                   tiles: dict[str, Tile], deterministic: bool | None = None,
                   debug: bool = False, *, q_dk=None, k_dq=None, quant_ds: bool = True,
                   delta_dp: bool = False):
    """(dq, dk, dv, ds_amax, dbg) for the units, output and lse of attention.forward_units.

    qu, ku: Q̂, K̂ with blocks along d (S is recomputed from them); vu: the V̂ of dP = dO V̂ᵀ.
    Tensor reuse (q_dk, k_dq None): vu is the forward's (blocks along keys) and dK, dQ multiply
    by qu, ku. reuse=False: vu has blocks along d, q_dk (blocks along queries) and k_dq (along
    keys) are given, all from attention_units.backward_operands (an ablation's, from
    fp4stack.nn.attention_ablation, may pass the forward's units for some). quant_ds False
    (ds=None): dS enters the dK and dQ dots unquantized (rounded to the dot dtype), there is
    no amax pass and ds_amax is None. do [B, H, S, d] is made contiguous. dbg (debug=True, else
    None) is
    [4, B, H, S, L] fp32: the raw dS the dK pass used, its dK operand's values (dŜ along queries),
    the raw dS the dQ pass used, its dQ operand's values (dŜ along keys); tiles no program
    visited stay NaN. deterministic: a dQ pass of its own instead of atomic adds (None:
    DETERMINISTIC). delta_dp (delta="dp"): dS = P ∘ (dP - rowsum(P ∘ dP)), the row sums from a
    sweep of their own in the first query pass (which, with ds=None, does nothing else),
    instead of rowsum(dO ∘ O).
    """
    deterministic = DETERMINISTIC if deterministic is None else deterministic
    reuse = q_dk is None and k_dq is None
    if not reuse and (q_dk is None or k_dq is None):
        raise ValueError("reuse=False needs both q_dk and k_dq")
    q_dk, k_dq = (qu, ku) if reuse else (q_dk, k_dq)  # unused by the kernels under reuse
    B, H, S, D = qu.shape
    Hkv, L = ku.shape[1], ku.shape[2]
    G = H // Hkv
    dev = qu.device
    do = do.contiguous()
    if not (S and L):
        ds_amax = torch.zeros((), device=dev) if quant_ds else None
        return torch.zeros_like(qu), torch.zeros_like(ku), torch.zeros_like(vu), ds_amax, None
    # Every key row is written by its dK/dV program (zeros where no query sees it).
    dk, dv = torch.empty_like(ku), torch.empty_like(vu)
    opts = _launch_options()
    mma_ty, precision = mma_type(qu.dtype)
    common = dict(D=D, CAUSAL=causal, REUSE=reuse, QUANT_DS=quant_ds, MMA_TY=mma_ty,
                  PRECISION=precision, SCALE_MAX=SCALE_MAX, **opts)
    delta = torch.empty((B, H, S), dtype=torch.float32, device=dev)
    out = out.contiguous()
    if quant_ds or delta_dp:  # delta and the global amax of dS, before any dS is quantized
        t = tiles["amax"]
        grid = (cdiv(S, t.block_m), B * H)
        partial = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=dev)
        amax4 = torch.cat([amax, amax[:1]])  # slot 3 (dS) unused by the amax pass
        query_kernel[grid](qu, ku, k_dq, vu, do, out, lse, delta, amax4, partial, partial,
                           partial, B * H, S, L, G, scale, BLOCK_M=t.block_m,
                           BLOCK_N=t.block_n, DQ=False, DEBUG=False, DELTA_DP=delta_dp,
                           **common, num_warps=t.num_warps, num_stages=t.num_stages)
        ds_amax = partial.amax() if quant_ds else None
        amax4 = torch.cat([amax, ds_amax.reshape(1)]) if quant_ds else amax4
    else:  # slot 3 is never read
        delta_kernel[(cdiv(B * H * S, 64),)](out, do, delta, B * H * S, D=D, BLOCK=64, **opts)
        ds_amax, amax4 = None, torch.cat([amax, amax[:1]])
    dbg = torch.full((4, B, H, S, L), float("nan"), device=dev) if debug else amax4
    dq_acc = torch.zeros((B, H, S, D), dtype=torch.float32, device=dev) if not deterministic \
        else amax4
    t = tiles["dkdv"]
    dkdv_kernel[(cdiv(L, t.block_n), B * Hkv)](
        qu, ku, q_dk, k_dq, vu, do, lse, delta, amax4, dk, dv, dq_acc, dbg, B * H, S, L, G,
        scale, BLOCK_M=t.block_m, BLOCK_N=t.block_n, ATOMIC_DQ=not deterministic, DEBUG=debug,
        **common, num_warps=t.num_warps, num_stages=t.num_stages)
    if deterministic:
        dq = torch.empty_like(qu)
        t = tiles["dq"]
        query_kernel[(cdiv(S, t.block_m), B * H)](
            qu, ku, k_dq, vu, do, out, lse, delta, amax4, amax4, dq, dbg, B * H, S, L, G, scale,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, DQ=True, DEBUG=debug, **common,
            num_warps=t.num_warps, num_stages=t.num_stages)
    else:  # the global factors, as query_kernel applies them
        factor = global_decode_scale(amax[1], SCALE_MAX)
        if quant_ds:
            factor = global_decode_scale(ds_amax, SCALE_MAX) * factor
        dq = (dq_acc * (factor * scale)).to(qu.dtype)
    return dq, dk, dv, ds_amax, (dbg if debug else None)
