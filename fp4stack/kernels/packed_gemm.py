"""Host side of the packed NVFP4 GEMMs: `packed_linear` (y = a Wᵀ + b with W dequantized in
registers), the grouped expert GEMM, per-row-amax activation quantization and Q(W)'s column norms.

Every launch has static shapes and reads nothing back, so the calls are CUDA-graph capturable.
The tile candidates are in one table (`GEMM_CONFIGS`, `GROUPED_CONFIGS`), picked by M (`M_BUCKETS`,
`GROUPED_BUCKETS`); `benchmarks/bench_packed_gemm.py --sweep` times them all on a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton.language as tl

from ..formats.spec import QuantSpec
from ..formats.tensor import BLOCK, NVFP4Tensor, padded_k
from . import cdiv, interpreted
from . import packed_gemm_jit as jit
from .nvfp4 import QUANTIZE_TILE, _launch_options

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GemmConfig:
    """One launch shape. block_m rows (dot: >= 16; a broadcast product without tensor cores
    when dot=False), block_n weight rows, block_k columns a step (a multiple of 16), split_k
    (0: chosen so that enough programs run to fill the SMs; else that many K splits). swap_ab:
    the dot computes (W aᵀ)ᵀ, the decoded weight tile as the MMA's register operand (Hopper's
    wgmma needs block_n >= 64 for it; block_m is then its N, 16 at least)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True
    swap_ab: bool = False

    def __post_init__(self) -> None:
        if self.block_k % 16 or self.block_k < 16:
            raise ValueError(f"GemmConfig.block_k must be a multiple of 16, got {self.block_k}")
        # Dots 16 wide in K gave wrong sums for bf16/fp16 operands on the H200 (Triton 3.6,
        # 2026-12-02; fp32 and K steps of 32 or more were right): refused for every dtype.
        if self.dot and self.block_k < 32:
            raise ValueError(f"GemmConfig.block_k must be >= 32 for tensor-core dots, got "
                             f"{self.block_k}; use 32 or more, or dot=False")


# Candidates; the lead retunes with benchmarks/bench_packed_gemm.py --sweep on the H200.
GEMM_CONFIGS: dict[str, GemmConfig] = {
    "gemv16x256": GemmConfig(4, 16, 256, dot=False),
    "gemv32x128": GemmConfig(4, 32, 128, dot=False),
    "gemv16x512": GemmConfig(4, 16, 512, dot=False),
    "dot16x32x128": GemmConfig(16, 32, 128),
    "dot16x64x64": GemmConfig(16, 64, 64),
    "dot16x64x128": GemmConfig(16, 64, 128),
    "swap16x64x64": GemmConfig(16, 64, 64, swap_ab=True),
    "swap16x64x128": GemmConfig(16, 64, 128, swap_ab=True),
    "swap16x128x128w8": GemmConfig(16, 128, 128, num_warps=8, swap_ab=True),
    "swap32x128x64": GemmConfig(32, 128, 64, num_warps=8, swap_ab=True),
    "dot32x64x64": GemmConfig(32, 64, 64),
    "dot64x64x128": GemmConfig(64, 64, 128, num_warps=8),
    "dot64x128x64": GemmConfig(64, 128, 64, num_warps=8),
    "dot128x128x64": GemmConfig(128, 128, 64, num_warps=8),
}
# (largest M, config): decode (M <= 16) reads each weight byte once per 16 rows; small N tiles
# and split-K give it enough programs. Swept on the H200 (bench_packed_gemm.py --sweep, splits
# auto/1/4, 2026-12-02): swap16x64x128 with the automatic split was fastest or within 4% of it
# at M = 1 and 16 on 16384x2048 and 2048x8192 (21.5 and 13.3 us at M = 1); the broadcast
# product (gemv*) took 26-31 and 16-19 us. Larger M keep the first-guess tiles (not swept).
M_BUCKETS: tuple[tuple[int, str], ...] = (
    (16, "swap16x64x128"), (32, "swap32x128x64"), (64, "dot64x64x128"),
    (256, "dot64x128x64"), (1 << 62, "dot128x128x64"),
)
# float32 operands: full-precision dots run on the FMA units, where big tiles spill.
FP32_M_BUCKETS: tuple[tuple[int, str], ...] = ((4, "gemv16x256"), (1 << 62, "swap16x64x64"))
# The grouped kernel's block_m is also the padding of each expert's rows (moe_align).
GROUPED_CONFIGS: dict[str, GemmConfig] = {
    "g16x64x64swap": GemmConfig(16, 64, 64, swap_ab=True),
    "g16x64x128": GemmConfig(16, 64, 128),
    "g32x64x64": GemmConfig(32, 64, 64),
    "g64x128x64": GemmConfig(64, 128, 64, num_warps=8),
}
# (largest mean rows per expert, config)
GROUPED_BUCKETS: tuple[tuple[float, str], ...] = (
    (16, "g16x64x64swap"), (48, "g32x64x64"), (float("inf"), "g64x128x64"),
)
PROGRAMS_PER_SM = 2  # split-K target: this many programs per SM
# Split-K partial sums added by the last split of each tile (one launch) instead of a second
# kernel; same bits either way. False: always the second kernel.
SERIAL_SPLIT_K = True
MAX_SPLIT_K = 16
MIN_K_TILES_PER_SPLIT = 2
SPLIT_MAX_M = 64  # above, the fp32 partial sums would cost more bytes than the weight


_TILE_LOCKS: dict[tuple, torch.Tensor] = {}


def tile_locks(device: torch.device, tiles: int) -> torch.Tensor | None:
    """Zeroed int32 tile counters for a serial split-K launch of `tiles` tiles on the current
    stream of `device` (each launch leaves them zero, and a stream runs its launches one after
    another, so one buffer a stream serves them all); None where none can be had: a buffer too
    small while a CUDA graph is being captured (allocating then would tie it to the graph)."""
    key = (device.type, device.index,
           torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    locks = _TILE_LOCKS.get(key)
    if locks is None or locks.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        locks = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
        _TILE_LOCKS[key] = locks
    return locks


@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (132 for a CPU tensor: the H200's, so the
    interpreter runs the launches a GPU would)."""
    return _sm_count(device.index) if device.type == "cuda" else 132


def choose_config(m: int, n: int, k: int, device: torch.device,
                  dtype: torch.dtype = torch.bfloat16) -> tuple[GemmConfig, int]:
    """(config, split_k) for an [m, k] x [n, k]ᵀ GEMM: the M bucket's config (FP32_M_BUCKETS
    for float32), and for m up to SPLIT_MAX_M as many K splits (powers of two) as bring the
    programs to PROGRAMS_PER_SM per SM, each split at least MIN_K_TILES_PER_SPLIT steps of
    block_k."""
    buckets = FP32_M_BUCKETS if dtype == torch.float32 else M_BUCKETS
    cfg = GEMM_CONFIGS[next(name for top, name in buckets if m <= top)]
    return cfg, split_for(cfg, m, n, k, device)


def split_for(cfg: GemmConfig, m: int, n: int, k: int, device: torch.device) -> int:
    """cfg.split_k, or when 0 the K splits that fill the SMs (see choose_config)."""
    if cfg.split_k:
        return cfg.split_k
    if m > SPLIT_MAX_M:
        return 1
    bm = effective_block_m(cfg, m)
    programs = cdiv(m, bm) * cdiv(n, cfg.block_n)
    k_tiles = cdiv(k, cfg.block_k)
    split, target = 1, PROGRAMS_PER_SM * sm_count(device)
    while (programs * split < target and split * 2 <= MAX_SPLIT_K
           and k_tiles >= 2 * split * MIN_K_TILES_PER_SPLIT):
        split *= 2
    return split


def effective_block_m(cfg: GemmConfig, m: int) -> int:
    """block_m, reduced for small m to the next power of two (16 at least for tensor-core dots)."""
    want = 1 << max(0, m - 1).bit_length()
    return min(cfg.block_m, max(want, 16 if cfg.dot else 1))


def _check_a(a: torch.Tensor, k: int) -> torch.Tensor:
    if a.dim() != 2 or a.shape[1] != k:
        raise ValueError(f"packed_linear: a must be [M, {k}] (the weight's K), got "
                         f"{tuple(a.shape)}")
    if a.dtype not in _DTYPES:
        raise TypeError(f"packed_linear: a must be float32, bfloat16 or float16, got {a.dtype}")
    return a if a.stride(1) == 1 else a.contiguous()


def _packed_parts(w: NVFP4Tensor):
    """(codes as int32 words [rows, KP/8], scale bytes [rows, KP/16]) of a 1x16 or 16x16 NVFP4
    weight (the kernels read the codes 16 bytes at a time)."""
    if w.spec.hadamard:
        raise ValueError("packed_linear: the weight was quantized with hadamard=True; its values "
                         "are in the transformed domain, so a GEMM with plain activations is wrong")
    kp = padded_k(w.shape[-1])
    return (_words(w.data.reshape(-1, kp // 2)),
            w.scales.view(torch.uint8).reshape(-1, kp // BLOCK))


def _words(data: torch.Tensor) -> torch.Tensor:
    """Packed codes [..., KP/2] uint8 as int32 words [..., KP/8] (the same bytes; KP is a
    multiple of 16, so a row is whole words)."""
    return (data if data.stride(-1) == 1 else data.contiguous()).view(torch.int32)


def _mma(dtype: torch.dtype) -> dict:
    """The dot's operand type and input precision: a's dtype (full-precision "ieee" for fp32:
    no TF32); float32 under the interpreter, whose bf16 dot is wrong (exact all the same)."""
    if dtype == torch.float32 or interpreted():
        return {"MMA_TY": tl.float32, "PRECISION": "ieee"}
    return {"MMA_TY": tl.bfloat16 if dtype == torch.bfloat16 else tl.float16,
            "PRECISION": "tf32"}  # the precision only matters for fp32 operands


def _exact(k: int, block_k: int | None = None) -> dict:
    """PAD_K: K leaves padding in its last block; NATIVE_CAST: compiled (the interpreter's
    bf16 cast is not round-to-nearest-even), plus the exact-maths launch options; with
    block_k, EVEN_K: K is a multiple of it (the GEMM's loads need no column mask)."""
    even = {} if block_k is None else {"EVEN_K": k % block_k == 0}
    return {"PAD_K": k % BLOCK != 0, "NATIVE_CAST": not interpreted(), **even,
            **_launch_options()}


def packed_linear(a: torch.Tensor, w: NVFP4Tensor | torch.Tensor, bias: torch.Tensor | None = None,
                  *, config: GemmConfig | None = None,
                  segments: tuple[int, ...] = ()) -> torch.Tensor:
    """y [M, N] = a @ Wᵀ (+ bias) in a.dtype for a [M, K] (fp32, bf16 or fp16).

    segments (N_1, .., N_J summing to N, J <= 3): W's rows are J sibling layers and a is
    [J, M, K], one operand each: y[:, rows of j] = a[j] @ W_jᵀ, in one launch when every
    boundary is a multiple of the tile's block_n, else one launch per sibling.

    W is an NVFP4Tensor [N, K] (1x16 blocks or 16x16 tiles, no Hadamard), whose values are
    exactly `fp4stack.dequantize(w, a.dtype)`, built in registers from the packed codes and
    scales; or a plain [N, K] tensor of a's dtype. Products are summed in float32 (no TF32 for
    fp32 operands), rounded once to a.dtype; a bias is then added as QuantLinear's reference
    adds it (rounded to a.dtype, added in float32, rounded again). Deterministic: split-K
    partial sums are added in split order, by the tile's last split (an atomic counter tells
    which) or, with SERIAL_SPLIT_K off, by a second launch.
    """
    if segments:
        return _segmented(a, w, bias, config, segments)
    return _dense(a, w, bias, config)


def _segmented(a, w, bias, config, segments):
    n = w.shape[0]
    if not 1 <= len(segments) <= 3 or sum(segments) != n or a.dim() != 3 or (
            a.shape[0] != len(segments)):
        raise ValueError(f"packed_linear: segments {segments} must be 1 to 3 sizes summing to "
                         f"the weight's {n} rows, with a [J, M, K] of one operand each; got a "
                         f"{tuple(a.shape)}")
    starts = [sum(segments[:j]) for j in range(1, len(segments))]
    cfg = config or narrower_tiles(
        choose_config(a.shape[1], n, a.shape[2], a.device, a.dtype)[0], starts)
    if all(b % cfg.block_n == 0 for b in starts):  # no tile straddles two siblings
        a = a.contiguous()
        return _dense(a[0], w, bias, cfg, a, (*starts, n, n)[:2])
    outs, r0 = [], 0
    for j, rows in enumerate(segments):
        wj = (NVFP4Tensor(w.data[r0:r0 + rows], w.scales[r0:r0 + rows], w.amax,
                          torch.Size((rows, w.shape[1])), w.spec)
              if isinstance(w, NVFP4Tensor) else w[r0:r0 + rows])
        outs.append(_dense(a[j], wj, None if bias is None else bias[r0:r0 + rows], config))
        r0 += rows
    return torch.cat(outs, dim=1)


def narrower_tiles(cfg: GemmConfig, bounds: list[int]) -> GemmConfig:
    """cfg with block_n halved until every sibling boundary in `bounds` is a whole tile, so
    fused siblings take one launch (e.g. q/k/v boundaries at 576 and 768 rows against block_n
    128); cfg itself when it already fits or no narrower tile would (block_n stays >= 16, and
    >= 64 for swap_ab, which wgmma needs). block_k and the K loop are unchanged."""
    floor = 64 if cfg.swap_ab else 16
    bn = cfg.block_n
    while any(b % bn for b in bounds) and bn // 2 >= floor:
        bn //= 2
    if bn == cfg.block_n or any(b % bn for b in bounds):
        return cfg
    return replace(cfg, block_n=bn)


def _dense(a, w, bias, config, a_segments=None, a_bounds=None):
    """packed_linear's launch; a_segments [J, M, K] (a its first) with the rows a_bounds at
    which the next operand starts: the fused siblings' GEMM."""
    packed = isinstance(w, NVFP4Tensor)
    if packed:
        if len(w.shape) != 2:
            raise ValueError(f"packed_linear: the weight must be 2-D [N, K], got {tuple(w.shape)}")
        n, k = w.shape
        wd, ws = _packed_parts(w)
        amax, scale_max, kp = w.amax, w.spec.scale_max, padded_k(k)
    else:
        if w.dim() != 2:
            raise ValueError(f"packed_linear: the weight must be 2-D [N, K], got {tuple(w.shape)}")
        n, k = w.shape
        wd = w if w.stride(1) == 1 else w.contiguous()
        ws, amax, scale_max, kp = wd, wd, QuantSpec().scale_max, k
    a = _check_a(a, k)
    if not packed and w.dtype != a.dtype:
        raise TypeError(f"packed_linear: a plain weight must have a's dtype {a.dtype}, got "
                        f"{w.dtype}; cast it (w.to(a.dtype))")
    m = a.shape[0]
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.to(a.dtype).expand(m, n))
    cfg, split = (choose_config(m, n, k, a.device, a.dtype) if config is None
                  else (config, split_for(config, m, n, k, a.device)))
    bm = effective_block_m(cfg, m)
    b = bias.to(a.dtype).contiguous() if bias is not None else out
    part = (torch.empty((split, m, n), dtype=torch.float32, device=a.device) if split > 1
            else out)
    grid = (cdiv(m, bm), cdiv(n, cfg.block_n), split)
    locks = tile_locks(a.device, grid[0] * grid[1]) if split > 1 and SERIAL_SPLIT_K else None
    seg_stride, bounds = (a_segments.stride(0), a_bounds) if a_segments is not None else (0, (n, n))
    jit.gemm_kernel[grid](
        a if a_segments is None else a_segments, wd, ws, amax, b, out, part, out, out,
        m, n, k, kp, a.stride(0), 0, 0 if packed else wd.stride(0), 1, seg_stride, *bounds,
        BM=bm, BN=cfg.block_n, BK=cfg.block_k, SPLIT_K=split, W_PACKED=packed,
        USE_DOT=cfg.dot, SWAP_AB=cfg.swap_ab, GROUPED=False, HAS_BIAS=bias is not None,
        SCALE_MAX=scale_max, A_SEGMENTS=a_segments is not None,
        **_mma(a.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        lock_ptr=locks, SERIAL_REDUCE=locks is not None, **_exact(k, cfg.block_k),
    )
    if split > 1 and locks is None:
        rm, rn = 16, 128
        jit.splitk_reduce_kernel[(cdiv(m, rm), cdiv(n, rn))](
            part, b, out, m, n, SPLIT_K=split, BM=rm, BN=rn, HAS_BIAS=bias is not None,
            NATIVE_CAST=not interpreted(), num_warps=4, **_launch_options(),
        )
    return out


@dataclass(frozen=True)
class PackedExperts:
    """A stack of E packed NVFP4 weights [E, N, K] (one global amax per expert), as QuantExperts
    holds them: data uint8 [E, N, KP/2], scales float8_e4m3fn [E, N, KP/16], amax float32 [E]."""

    data: torch.Tensor
    scales: torch.Tensor
    amax: torch.Tensor
    k: int
    spec: QuantSpec

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data.shape[0], self.data.shape[1], self.k)


def grouped_gemm(a: torch.Tensor, a_div: int, w: PackedExperts | torch.Tensor,
                 sorted_rows: torch.Tensor, tile_expert: torch.Tensor, pairs: int,
                 cfg: GemmConfig) -> torch.Tensor:
    """out [pairs, N] in a.dtype: row r (a token-expert pair) = a[r // a_div] @ W[e]ᵀ, e the
    expert of r's tile; the tiles (`sorted_rows`, `tile_expert`) come from moe_align. W is
    PackedExperts or a plain [E, N, K] tensor of a's dtype. One launch for all experts."""
    packed = isinstance(w, PackedExperts)
    e, n, k = w.shape
    a = _check_a(a, k)
    if packed:
        if w.spec.hadamard:
            raise ValueError("grouped_gemm: expert weights quantized with hadamard=True")
        kp = padded_k(k)
        wd, ws, amax, scale_max = (_words(w.data), w.scales.view(torch.uint8), w.amax,
                                   w.spec.scale_max)
        swe = swn = 0
    else:
        if w.dtype != a.dtype:
            raise TypeError(f"grouped_gemm: plain expert weights must have a's dtype {a.dtype}, "
                            f"got {w.dtype}")
        wd = w if w.stride(2) == 1 else w.contiguous()
        ws = amax = wd
        kp, scale_max, swe, swn = k, QuantSpec().scale_max, wd.stride(0), wd.stride(1)
    out = torch.empty((pairs, n), dtype=a.dtype, device=a.device)
    n_tiles = tile_expert.numel()
    if pairs == 0 or n == 0 or n_tiles == 0:
        return out
    if k == 0:
        return out.zero_()
    jit.gemm_kernel[(n_tiles, cdiv(n, cfg.block_n), 1)](
        a, wd, ws, amax, out, out, out, sorted_rows, tile_expert,
        pairs, n, k, kp, a.stride(0), swe, swn, a_div, 0, n, n,
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, SPLIT_K=1, W_PACKED=packed,
        USE_DOT=cfg.dot, SWAP_AB=cfg.swap_ab, GROUPED=True, HAS_BIAS=False,
        SCALE_MAX=scale_max,
        **_mma(a.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_exact(k, cfg.block_k),
    )
    return out


def choose_grouped_config(pairs: int, n_experts: int,
                          dtype: torch.dtype = torch.bfloat16) -> GemmConfig:
    """The GROUPED_BUCKETS config for `pairs` token-expert pairs over `n_experts` experts (the
    first, smallest one for float32, whose full-precision dots run on the FMA units)."""
    mean = pairs / max(n_experts, 1) if dtype != torch.float32 else 0.0
    return GROUPED_CONFIGS[next(name for top, name in GROUPED_BUCKETS if mean <= top)]


def rows_fake_quantize_supported(spec: QuantSpec) -> bool:
    """Whether `rows_fake_quantize` computes `spec`: NVFP4, 1x16 blocks, round to nearest (Four
    Over Six allowed). Stochastic rounding is not: the reference draws a new seed per expert."""
    return (spec.format == "nvfp4" and spec.block == (1, 16) and spec.rounding == "rne"
            and not spec.hadamard)


def rows_fake_quantize(x: torch.Tensor, row_div: int, amax: torch.Tensor, group: torch.Tensor,
                       spec: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    """out [R, K] in `dtype`, R = group.numel(): out[r] = fake_quantize(x[r // row_div], spec,
    amax=amax[group[r]]) bit for bit (x [R / row_div, K]; amax float32 [G]). No host sync."""
    if not rows_fake_quantize_supported(spec):
        raise ValueError(f"rows_fake_quantize: spec {spec} is not supported; it takes NVFP4 1x16 "
                         "round-to-nearest specs (four_over_six allowed)")
    if x.dtype not in _DTYPES or dtype not in _DTYPES:
        raise TypeError(f"rows_fake_quantize: x and dtype must be float32, bfloat16 or float16, "
                        f"got {x.dtype} -> {dtype}")
    r, k = group.numel(), x.shape[-1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((r, k), dtype=dtype, device=x.device)
    if r == 0 or k == 0:
        return out
    tile = QUANTIZE_TILE
    grid = (cdiv(r, tile.block_m), cdiv(padded_k(k), tile.block_k), 1)
    jit.rows_fake_quantize_kernel[grid](
        x, amax, group, out, r, k, x.stride(0), row_div,
        BM=tile.block_m, KB=tile.blocks_k, FOUR_OVER_SIX=spec.four_over_six,
        SCALE_MAX=spec.scale_max, num_warps=tile.num_warps, **_launch_options(),
    )
    return out


def column_sq_norms(w: NVFP4Tensor | PackedExperts, dtype: torch.dtype) -> torch.Tensor:
    """float32 [K] (a weight [N, K]) or [E, K] (a stack of E): per column c, sum over rows of
    dequantize(w, dtype)[:, c]² (squares and sums in float32, rows in a fixed order), without
    writing the dequantized weight."""
    stack = isinstance(w, PackedExperts)
    if not stack and len(w.shape) != 2:
        raise ValueError(f"column_sq_norms: the weight must be 2-D, got {tuple(w.shape)}")
    if stack and w.spec.hadamard:
        raise ValueError("column_sq_norms: expert weights quantized with hadamard=True")
    e, n, k = w.shape if stack else (1, *w.shape)
    wd, ws = (_words(w.data), w.scales.view(torch.uint8)) if stack else _packed_parts(w)
    out = torch.empty((e, k), dtype=torch.float32, device=w.data.device)
    if k == 0 or e == 0:
        return out if stack else out[0]
    if n == 0:
        out.zero_()
        return out if stack else out[0]
    like = torch.empty(1, dtype=dtype, device=w.data.device)
    bn, bk = 32, 32
    jit.column_sq_norms_kernel[(cdiv(k, bk), e)](
        wd, ws, w.amax, like, out, n, k, padded_k(k), BN=bn, BK=bk,
        SCALE_MAX=w.spec.scale_max, num_warps=4, **_exact(k),
    )
    return out if stack else out[0]
