"""Host side of the Triton NVFP4 kernels: same signatures and bits as fp4stack.formats.nvfp4."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from ..formats import nvfp4 as reference
from ..formats.hadamard import RHT_SIGNS
from ..formats.random import draw_seed, seed_keys
from ..formats.spec import QuantSpec
from ..formats.tensor import BLOCK, NVFP4Tensor, padded_k
from . import cdiv, interpreted
from . import nvfp4_kernels as kj

SIGN_MASK = sum(1 << i for i, s in enumerate(RHT_SIGNS) if s < 0)
# Bit-exactness needs every float32 op rounded on its own, and libdevice's division must keep
# subnormals, as torch does on the CPU.
_EXACT = {"enable_fp_fusion": False, "enable_reflect_ftz": False}


@dataclass(frozen=True)
class TileConfig:
    """Rows x 16-element blocks each program handles, and its warps (tuned on the H200 with
    benchmarks/bench_quantize.py --sweep)."""

    block_m: int = 16
    blocks_k: int = 16
    num_warps: int = 4

    @property
    def block_k(self) -> int:
        return 16 * self.blocks_k


# 2048 elements and 64 threads a program: the fastest of the sweep on the H200 (see
# docs/PERFORMANCE.md); 16x16 tiles need 16 rows, so they take fewer blocks a row.
QUANTIZE_TILE = TileConfig(block_m=4, blocks_k=32, num_warps=2)
QUANTIZE_TILE_2D = TileConfig(block_m=16, blocks_k=8, num_warps=2)
AMAX_TILE = TileConfig(block_m=32, blocks_k=32, num_warps=8)
# A column-major operand (a transposed view: the backward's column-wise copies of x and dy) has
# its rows contiguous in memory. The row-major tiles would read 4 or 32 neighbouring rows (8-64
# bytes) of each column; these take many rows and few blocks, so a warp's load covers 64 or 128
# neighbouring rows of one column, and no transposed copy is made (with TRANSPOSE_IN_KERNEL,
# below). Any tile gives the same bits (whole 16x16 tiles: block_m is a multiple of 16).
QUANTIZE_TILE_T = TileConfig(block_m=64, blocks_k=2, num_warps=2)
AMAX_TILE_T = TileConfig(block_m=128, blocks_k=4, num_warps=4)
# fake_quantize_pair: rows x blocks of x a program takes for both of its operands (block_m a
# multiple of 16: whole blocks of xᵀ).
PAIR_TILE = TileConfig(block_m=32, blocks_k=4, num_warps=4)
# Whether a transposed operand is read in place (the column-major tiles above, and the pair
# kernel for a linear's two operands) or first copied to contiguous rows for the row-major
# kernels. Off: on the H200 (2026-12-05, `medium` preset, nvfp4-nvidia, compiled) the in-place
# kernels made the step 1.42x slower (1,194 against 839 ms). Triton lays their tiles out for
# coalesced loads along the transposed rows, so a block's 16 elements sit in different threads
# and warps, and every block maximum and Hadamard butterfly goes through shared memory: the
# pair kernel took 567 us a call and the column-wise RHT amax 225 us, against 46 and 25 us a
# call for a transposed copy and the row-major kernels. The in-place kernels give the same
# bits and stay tested (their tests switch this on), for a layout that keeps a block in one
# thread.
TRANSPOSE_IN_KERNEL = False
# Operands up to this many elements (a decoding step's activations) take the one-program amax.
SMALL_AMAX = 1 << 16
# Operands up to this many elements, read whole (or their rows whole) by at most
# AMAX_HERE_READS / numel programs, have their amax computed by the programs that quantize them
# (`amax_here`): one launch saved for a few L2 reads. On the
# H200 (2026-12-04) a 16 x 4096 operand read whole by each of 32 programs of 64 threads cost
# 28 us more than the amax launch first (decoding at batch 16: -5 to -11% tokens/s); one row
# cost nothing measurable either way.
AMAX_HERE_ELEMENTS = 1 << 13
AMAX_HERE_READS = 1 << 22
# Under the interpreter each program's read of the whole tensor is a loop of numpy calls, so
# there the amax launch goes first (the same bits; tests set this to take the other path).
INTERPRETED_AMAX_HERE_READS = 0
DEQUANTIZE_TILE = TileConfig()


@functools.cache
def _launch_options(maxnreg: int = 0) -> dict:
    """The options of _EXACT this Triton knows (none under the interpreter), and with `maxnreg`
    a cap on registers per thread where this Triton has one."""
    if interpreted():
        return {}
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return {}
    known = CUDAOptions.__dataclass_fields__
    options = {k: v for k, v in _EXACT.items() if k in known}
    if maxnreg and "maxnreg" in known:
        options["maxnreg"] = maxnreg
    return options


def _as_3d(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """x as a [B, M, K] view: 16x16 tiles never straddle B; 1x16 flattens all rows into M."""
    if spec.is_2d:
        return x.reshape(-1, x.shape[-2], x.shape[-1])
    return x.reshape(1, -1, x.shape[-1])


def _int32(k: int) -> int:
    return k - (1 << 32) if k >= 1 << 31 else k


def column_major(x3: torch.Tensor) -> bool:
    """Whether x3 [B, M, K] has its rows, not its columns, contiguous (a transposed view)."""
    return x3.shape[1] > 1 and x3.shape[2] > 1 and x3.stride(1) == 1 and x3.stride(2) != 1


def _rows_contiguous(x3: torch.Tensor) -> torch.Tensor:
    """x3, copied to contiguous rows if it is column-major and the kernels do not read
    transposed operands in place (TRANSPOSE_IN_KERNEL)."""
    return x3.contiguous() if column_major(x3) and not TRANSPOSE_IN_KERNEL else x3


def _quantize_tile(x3: torch.Tensor, spec: QuantSpec) -> TileConfig:
    """The quantize kernel's tile for x3: column-major, 16x16 tiles, or the row-major one."""
    if column_major(x3):
        return QUANTIZE_TILE_T
    return QUANTIZE_TILE_2D if spec.is_2d else QUANTIZE_TILE


def _grid(x3: torch.Tensor, kp: int, tile: TileConfig) -> tuple[int, int, int]:
    b, m, _ = x3.shape
    return cdiv(m, tile.block_m), cdiv(kp, tile.block_k), b


def _amax(x3: torch.Tensor, spec: QuantSpec, per_matrix: bool = False) -> torch.Tensor:
    """The global amax of x3 [B, M, K]: 0-d, or [B * M] for a row-scaled spec, or with
    per_matrix one a matrix x3[b], [B]. Up to SMALL_AMAX elements one program computes it (one
    launch); above, a grid of programs and a torch reduction of their partial maxima (numbered
    matrix by matrix)."""
    x3 = _rows_contiguous(x3)
    b, m, k = x3.shape
    rows = spec.row_scaled
    if b * m * k <= SMALL_AMAX:
        bm = min(triton.next_power_of_2(m), 16)
        out = torch.empty(b * m if rows or per_matrix else (), dtype=torch.float32,
                          device=x3.device)
        kj.amax_small_kernel[(1,)](
            x3, out, b, m, k, *x3.stride(), BM=bm, KB=max(1, 256 // bm),
            HADAMARD=spec.hadamard, SIGN_MASK=SIGN_MASK, ROWS=rows or per_matrix, num_warps=4,
            **_launch_options(),
        )
        return out.view(b, m).amax(1) if per_matrix else out
    tile = AMAX_TILE_T if column_major(x3) else AMAX_TILE
    grid = _grid(x3, padded_k(k), tile)
    n = grid[1] * b * m if rows else grid[0] * grid[1] * grid[2]
    partial = torch.empty(n, dtype=torch.float32, device=x3.device)
    kj.amax_kernel[grid](
        x3, partial, m, k, *x3.stride(),
        BM=tile.block_m, KB=tile.blocks_k, HADAMARD=spec.hadamard, SIGN_MASK=SIGN_MASK,
        ROWS=rows, num_warps=tile.num_warps, **_launch_options(),
    )
    if per_matrix:
        return partial.view(b, -1).amax(1)
    return partial.view(grid[1], b * m).amax(0) if rows else partial.amax()


def amax_here(numel: int, programs: int) -> bool:
    """Whether `programs` programs quantizing `numel` elements should each compute the amax
    they need themselves (see AMAX_HERE_READS): `programs` counts those reading the whole
    tensor, or for a row-scaled operand the programs along a row (each reads its rows whole)."""
    reads = INTERPRETED_AMAX_HERE_READS if interpreted() else AMAX_HERE_READS
    return numel <= AMAX_HERE_ELEMENTS and numel * programs <= reads


def global_amax(x: torch.Tensor, hadamard: bool = False) -> torch.Tensor:
    """max |x| (after the 16-point Hadamard transform when `hadamard`) by the amax kernel, as
    a float32 0-d tensor; the amax `quantize` computes when none is imposed."""
    spec = QuantSpec(hadamard=hadamard)
    reference.check_input(x, spec, "input")
    return _amax(_as_3d(x, spec), spec)


def _run(x: torch.Tensor, spec: QuantSpec, amax, seed, name: str, fake: bool,
         out_dtype: torch.dtype | None = None, per_matrix: bool = False):
    # per_matrix: each matrix x3[b] of x [..., M, K] with its own amax (a stack; no amax given)
    reference.check_input(x, spec, name)
    x3 = _rows_contiguous(x.reshape(-1, *x.shape[-2:]) if per_matrix else _as_3d(x, spec))
    b, m, k = x3.shape
    kp = padded_k(k)
    check = spec.nan_policy == "raise"
    tile = _quantize_tile(x3, spec)
    grid = _grid(x3, kp, tile)
    # With the amax computed here, a non-finite input shows in it; otherwise the kernel counts.
    check_amax = here = False
    if spec.row_scaled:
        reference.refuse_row_amax(amax, name)
    if per_matrix:
        amax_t = _amax(x3, spec, per_matrix=True)
        check_amax, check = check, False
    elif amax is None:
        # A small operand (a decoding step's) has its amax computed by the quantize kernel's
        # programs themselves, each from the whole tensor (or its own rows): one launch.
        here = amax_here(b * m * k, grid[1] if spec.row_scaled else grid[0] * grid[1] * grid[2])
        amax_t = (torch.empty(b * m if spec.row_scaled else (), dtype=torch.float32,
                              device=x.device) if here else _amax(x3, spec))
        check_amax, check = check, False
    else:
        amax_t = reference.as_amax(amax, x.device, check=spec.nan_policy == "raise")

    k1 = k2 = 0
    if spec.rounding == "stochastic":
        # A tensor seed is a CPU tensor (torch's CPU generator): reading it waits on nothing.
        k1, k2 = seed_keys(draw_seed() if seed is None else int(seed))

    dev = x.device
    if fake:
        # The kernel rounds its float32 values to out_dtype once, as the reference's cast does.
        out = torch.empty((b, m, k), dtype=out_dtype or x.dtype, device=dev)
        data = scales = out  # not written when FAKE
    else:
        data = torch.empty((b, m, kp // 2), dtype=torch.uint8, device=dev)
        scales = torch.empty((b, m, kp // BLOCK), dtype=torch.uint8, device=dev)
        out = data  # not written unless FAKE
    nonfinite = torch.empty(grid[0] * grid[1] * grid[2] if check else 1, dtype=torch.int32,
                            device=dev)
    kj.quantize_kernel[grid](
        x3, amax_t, data, scales, out, nonfinite,
        m, k, kp, *x3.stride(), _int32(k1), _int32(k2),
        BM=tile.block_m, KB=tile.blocks_k, IS_2D=spec.is_2d, HADAMARD=spec.hadamard,
        SIGN_MASK=SIGN_MASK, STOCHASTIC=spec.rounding == "stochastic",
        FOUR_OVER_SIX=spec.four_over_six, SCALE_MAX=spec.scale_max, FAKE=fake,
        CHECK_FINITE=check, ROW_AMAX=spec.row_scaled, AMAX_HERE=here, B=b,
        MATRIX_AMAX=per_matrix, num_warps=tile.num_warps, **_launch_options(),
    )
    # Checked after the launch, so the host waits while the kernel runs, not before it.
    if check_amax:
        reference.raise_if_flagged(not bool(torch.isfinite(amax_t).all().item()), x, name)
    if check:
        reference.raise_if_flagged(bool(nonfinite.sum().item()), x, name)
    if fake:
        return out.reshape(x.shape)
    if per_matrix:
        scales = scales.view(torch.float8_e4m3fn)
        return [NVFP4Tensor(data=data[i], scales=scales[i], amax=amax_t[i], shape=(m, k),
                            spec=spec) for i in range(b)]
    lead = x.shape[:-1]
    scales = scales.view(torch.float8_e4m3fn).reshape(*lead, kp // BLOCK)
    if spec.row_scaled:
        amax_t = amax_t.reshape(*lead, 1)
    return NVFP4Tensor(
        data=data.reshape(*lead, kp // 2), scales=scales, amax=amax_t, shape=x.shape, spec=spec
    )


def quantize(
    x: torch.Tensor,
    spec: QuantSpec = QuantSpec(),
    *,
    amax: float | torch.Tensor | None = None,
    seed: int | None = None,
    name: str = "input",
) -> NVFP4Tensor:
    """Triton NVFP4 quantization; bit-exact with fp4stack.formats.nvfp4.quantize."""
    if x.numel() == 0:
        return reference.quantize(x, spec, amax=amax, seed=seed, name=name)
    return _run(x, spec, amax, seed, name, fake=False)


def fake_quantize(
    x: torch.Tensor,
    spec: QuantSpec = QuantSpec(),
    *,
    amax: float | torch.Tensor | None = None,
    seed: int | None = None,
    name: str = "input",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Fused quantize -> dequantize in one pass; bit-exact with the reference's fake_quantize."""
    if x.numel() == 0:
        return reference.fake_quantize(x, spec, amax=amax, seed=seed, name=name, dtype=dtype)
    return _run(x, spec, amax, seed, name, fake=True, out_dtype=dtype)


def _check_stack(x: torch.Tensor, spec: QuantSpec, name: str) -> None:
    reference.check_units_spec(spec, "quantize_stack")
    if x.dim() < 2:
        raise ValueError(f"{name}: quantize_stack takes matrices, got shape {tuple(x.shape)}")


def quantize_stack(x: torch.Tensor, spec: QuantSpec, name: str = "input") -> list[NVFP4Tensor]:
    """Each matrix of x [..., M, K] quantized as alone (its own global amax), in two or three
    launches for the stack instead of two a matrix; reference.quantize_stack's bits."""
    _check_stack(x, spec, name)
    if x.numel() == 0:
        return reference.quantize_stack(x, spec, name)
    return _run(x, spec, None, None, name, fake=False, per_matrix=True)


def fake_quantize_stack(x: torch.Tensor, spec: QuantSpec, *, name: str = "input",
                        dtype: torch.dtype | None = None) -> torch.Tensor:
    """fake_quantize of each matrix of x [..., M, K] with its own global amax, in one pass for
    the stack; reference.fake_quantize_stack's bits."""
    _check_stack(x, spec, name)
    if x.numel() == 0:
        return reference.fake_quantize_stack(x, spec, name=name, dtype=dtype)
    return _run(x, spec, None, None, name, fake=True, out_dtype=dtype, per_matrix=True)


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Triton NVFP4 dequantization; bit-exact with fp4stack.formats.nvfp4.dequantize."""
    k = t.shape[-1]
    if t.data.numel() == 0 or k == 0:
        return reference.dequantize(t, dtype)
    kp = padded_k(k)
    data = t.data.reshape(-1, kp // 2)
    scales = t.scales.view(torch.uint8).reshape(-1, kp // BLOCK)
    r = data.shape[0]
    out = torch.empty((r, k), dtype=dtype, device=t.device)
    tile = DEQUANTIZE_TILE
    grid = (cdiv(r, tile.block_m), cdiv(kp, tile.block_k))
    kj.dequantize_kernel[grid](
        data, scales, t.amax.reshape(-1) if t.spec.row_scaled else t.amax, out, r, k, kp,
        BM=tile.block_m, BK=tile.block_k, SCALE_MAX=t.spec.scale_max,
        ROW_AMAX=t.spec.row_scaled, num_warps=tile.num_warps, **_launch_options(),
    )
    return out.reshape(t.shape)


def pair_fusable(x: torch.Tensor, spec: QuantSpec, spec_t: QuantSpec) -> bool:
    """Whether `fake_quantize_pair` makes both operands in one kernel: transposed operands
    are read in place (TRANSPOSE_IN_KERNEL), x is a non-empty matrix, both specs NVFP4 with
    1x16 blocks, one global scale and no NaN check (the linears' operands)."""
    return TRANSPOSE_IN_KERNEL and x.dim() == 2 and x.numel() > 0 and all(
        s.format == "nvfp4" and not s.is_2d and not s.row_scaled and s.nan_policy == "propagate"
        for s in (spec, spec_t))


def _amax_pair(x: torch.Tensor, hadamard: bool, hadamard_t: bool):
    """The global amaxes of x along its rows and of xᵀ along its rows (each transformed where
    asked), from one read of x: two 0-d float32 tensors."""
    m, k = x.shape
    tile = PAIR_TILE
    grid = (cdiv(m, tile.block_m), cdiv(k, tile.block_k), 1)
    partial = torch.empty(2, grid[0] * grid[1], dtype=torch.float32, device=x.device)
    kj.amax_pair_kernel[grid](
        x, partial[0], partial[1], m, k, *x.stride(), BM=tile.block_m, KB=tile.blocks_k,
        HADAMARD=hadamard, HADAMARD_T=hadamard_t, SIGN_MASK=SIGN_MASK,
        num_warps=tile.num_warps, **_launch_options(),
    )
    both = partial.amax(1)
    return both[0], both[1]


def fake_quantize_pair(
    x: torch.Tensor, spec: QuantSpec, spec_t: QuantSpec, *, amax=None, amax_t=None, seed=None,
    seed_t=None, cols_t: int | None = None, dtype: torch.dtype | None = None,
    name: str = "input",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fake_quantize(x, spec), fake_quantize(xᵀ zero-padded to `cols_t` columns, spec_t)) with
    the same bits (and random draws, in that order) as the two calls, from one read of x where
    `pair_fusable`: a linear's forward operand and its backward's column-wise one."""
    m, k = x.shape[-2], x.shape[-1]
    cols_t = m if cols_t is None else cols_t
    reference.check_pair(x, spec, spec_t, cols_t, name)
    if not pair_fusable(x, spec, spec_t):
        xt = x.t()
        if cols_t > m:
            xt = torch.nn.functional.pad(xt, (0, cols_t - m))
        return (fake_quantize(x, spec, amax=amax, seed=seed, name=name, dtype=dtype),
                fake_quantize(xt, spec_t, amax=amax_t, seed=seed_t, name=name, dtype=dtype))
    x3 = x.reshape(1, m, k)
    same = not spec.hadamard and not spec_t.hadamard  # max |x| is max |xᵀ|; not so transformed
    if amax is None and amax_t is None and not same and m * k > SMALL_AMAX:
        amax_r, amax_c = _amax_pair(x, spec.hadamard, spec_t.hadamard)
    else:
        amax_r = (_amax(x3, spec) if amax is None
                  else reference.as_amax(amax, x.device, check=False))
        if amax_t is not None:
            amax_c = reference.as_amax(amax_t, x.device, check=False)
        elif amax is None and same:
            amax_c = amax_r
        else:
            amax_c = _amax(x.t().reshape(1, k, m), spec_t)
    keys = []
    for s, sd in ((spec, seed), (spec_t, seed_t)):  # drawn in the two calls' order
        k1 = k2 = 0
        if s.rounding == "stochastic":
            k1, k2 = seed_keys(draw_seed() if sd is None else int(sd))
        keys += [_int32(k1), _int32(k2)]
    out = torch.empty((m, k), dtype=dtype or x.dtype, device=x.device)
    out_t = torch.empty((k, cols_t), dtype=dtype or x.dtype, device=x.device)
    tile = PAIR_TILE
    grid = (cdiv(m, tile.block_m), cdiv(k, tile.block_k), 1)
    kj.quantize_pair_kernel[grid](
        x, amax_r, amax_c, out, out_t, m, k, padded_k(k), cols_t, padded_k(cols_t),
        *x.stride(), *keys, BM=tile.block_m, KB=tile.blocks_k, SIGN_MASK=SIGN_MASK,
        HADAMARD=spec.hadamard, STOCHASTIC=spec.rounding == "stochastic",
        FOUR_OVER_SIX=spec.four_over_six, SCALE_MAX=spec.scale_max,
        HADAMARD_T=spec_t.hadamard, STOCHASTIC_T=spec_t.rounding == "stochastic",
        FOUR_OVER_SIX_T=spec_t.four_over_six, SCALE_MAX_T=spec_t.scale_max,
        num_warps=tile.num_warps, **_launch_options(),
    )
    return out, out_t


def quantize_units(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Each matrix of x [..., M, K] quantized with its own global amax, as units (float32 E2M1
    value x E4M3 block scale) and the amaxes: reference.quantize_units's bits, in three launches
    for the whole stack (amax, its reduction per matrix, quantize) instead of two a matrix."""
    reference.check_input(x, spec, "input")
    reference.check_units_spec(spec)
    if x.dim() < 2:
        raise ValueError(f"quantize_units takes matrices, got shape {tuple(x.shape)}")
    m, k = x.shape[-2:]
    x3 = _rows_contiguous(x.reshape(-1, m, k))
    b = x3.shape[0]
    if x3.numel() == 0:
        return reference.quantize_units(x, spec)
    amax = _amax(x3, spec, per_matrix=True)
    out = torch.empty((b, m, k), dtype=torch.float32, device=x.device)
    tile = _quantize_tile(x3, spec)
    kj.quantize_kernel[_grid(x3, padded_k(k), tile)](
        x3, amax, out, out, out, out, m, k, padded_k(k), *x3.stride(), 0, 0,
        BM=tile.block_m, KB=tile.blocks_k, IS_2D=spec.is_2d, HADAMARD=spec.hadamard,
        SIGN_MASK=SIGN_MASK, STOCHASTIC=False, FOUR_OVER_SIX=spec.four_over_six,
        SCALE_MAX=spec.scale_max, FAKE=True, CHECK_FINITE=False, ROW_AMAX=False, B=b,
        MATRIX_AMAX=True, UNITS=True, num_warps=tile.num_warps, **_launch_options(),
    )
    return out.reshape(x.shape), amax.reshape(x.shape[:-2])
