"""QUADS's GEMM operand on the device, for a dense layer or every expert of a grouped MoE at once:

    y = Q(x) Q(W)ᵀ + (x - Q(x))[:, C] Q(W)[:, C]ᵀ = x~ Q(W)ᵀ,

x~ being Q(x) with the compensated channels C put back to x's own values. Two launches after the
amax (a small operand's amax, a decoding step's, is computed by the first launch's programs
themselves), no host sync, static shapes (CUDA-graph capturable):

1. `quantize_energy_kernel`, a program per (group, block of columns): it walks the group's rows
   (the layer's, or one expert's token-expert pairs in moe_align's tiles), writes Q(x) (into
   each of J outputs) and sums the squared residual (x - Q(x), rounded to x's dtype, squared in
   float32) over the rows. With static channels (keep masks) there are no sums and the launch
   is all of x~; its programs then share a group's row tiles out (`row_splits`).
2. `select_kernel`, a program per (tile of rows, output j): the energies, those sums times
   ||Q(W_j)[:, c]||² (`nn.compensation.channel_energy`), its group's count channels of highest
   energy (`top_mask`'s rule: ties lowest index first), and x written over Q(x) there.
J > 1 serves sibling layers of one input (q/k/v, gate/up): one Q(x) and one residual sum, a
channel choice and an x~ per sibling, each by its own weight's norms.

Q(x) is the reference quantizer's bit for bit (1x16 blocks, round to nearest, Four Over Six
allowed; one amax per group, imposed, or per row). The energy sums a tile's rows as a tree and the
tiles in order, where torch's `sum(0)` has its own order: the two can differ in the last bits,
which moves a channel only where two energies tie to that rounding (at one row they are equal).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.spec import QuantSpec
from . import cdiv
from .nvfp4 import _amax, _launch_options, amax_here
from .nvfp4_jit import cast_rne, load_halves
from .nvfp4_kernels import row_abs_max, tensor_abs_max
from .packed_gemm import rows_fake_quantize_supported
from .packed_gemm_jit import fake_quantize_halves
from .top_mask import MAX_LENGTH, top_k_mask

DENSE_TILE = 16  # rows a dense layer's programs take at once
ENERGY_BLOCKS = 4  # 16-column blocks a quantize_energy program covers
MAX_ROW_SPLITS = 16  # programs sharing a group's row tiles, static channels
AMAX_BLOCKS = tl.constexpr(32)  # 16-column blocks a step of its in-kernel amax reads


@triton.jit
def quantize_energy_kernel(x_ptr, amax_ptr, rows_ptr, tiles_ptr, q_ptr, sums_ptr, keep_ptr,
                           R, K, sxm, DIV, N_TILES, J, QS, G,
                           TILE: tl.constexpr, KB: tl.constexpr, SORTED: tl.constexpr,
                           ROW_AMAX: tl.constexpr, FOUR_OVER_SIX: tl.constexpr,
                           SCALE_MAX: tl.constexpr, AMAX_HERE: tl.constexpr = False,
                           KEEP: tl.constexpr = False):
    """q[j, r] = fake_quantize(x[r // DIV]) (j < J) for the rows r of group g = program_id(0),
    and sums[g, c] = sum_r (x - q)[r, c]² over the columns of program_id(1); output j starts
    QS elements after output j - 1. KEEP (static channels): no sums; q[j, r, c] = x[r // DIV, c]
    where keep[j * G + g, c] (bool) is set, the whole x~ in this one launch. The group's tiles
    are shared out over program_id(2) (t0 + pid, t0 + pid + num_programs, ...): one program on
    that axis with sums, which add the tiles in order; more with KEEP, whose rows are
    independent.
    SORTED: the group's rows are rows_ptr[t * TILE ...] for its tiles tiles_ptr[g] ..
    tiles_ptr[g + 1] (R marks padding); else rows 0 .. R in N_TILES tiles. The amax is
    amax[r // DIV] (ROW_AMAX) or amax[g]; AMAX_HERE: computed by the program itself, x's rows'
    (ROW_AMAX) or, dense, the whole x's (one launch fewer for a small operand)."""
    g = tl.program_id(0)
    kbs = tl.program_id(1) * KB + tl.arange(0, KB)
    if SORTED:
        t0 = tl.load(tiles_ptr + g)
        t1 = tl.load(tiles_ptr + g + 1)
    else:
        t0 = 0
        t1 = N_TILES
    col_lo = kbs[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]
    sources = tl.cdiv(R, DIV)
    acc_lo = tl.zeros((KB, 8), dtype=tl.float32)
    acc_hi = tl.zeros((KB, 8), dtype=tl.float32)
    if AMAX_HERE and not ROW_AMAX:
        x_amax = tensor_abs_max(x_ptr, 1, sources, K, 0, sxm, 1, TILE, AMAX_BLOCKS, False, 0)
    for t in range(t0 + tl.program_id(2), t1, tl.num_programs(2)):
        slot = t * TILE + tl.arange(0, TILE)
        if SORTED:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
            rows = tl.load(rows_ptr + slot)
        else:
            rows = slot
        ok = rows < R
        src = tl.where(ok, rows // DIV, sources)  # padding reads nothing
        # Batch index 0, as a tensor (load_halves casts it); program_id(2) splits the rows.
        lo, hi, mask_lo, mask_hi = load_halves(x_ptr, g * 0, src, kbs, sources, K,
                                               0, sxm, 1, False, 0)
        if AMAX_HERE:
            if ROW_AMAX:
                amax = row_abs_max(x_ptr, tl.full((), 0, tl.int64), src, sources, K, 0, sxm, 1,
                                   AMAX_BLOCKS, False, 0)
            else:
                amax = x_amax + tl.zeros((TILE,), tl.float32)
        elif ROW_AMAX:
            amax = tl.load(amax_ptr + src, mask=ok, other=1.0)
        else:
            amax = tl.load(amax_ptr + g + tl.zeros((TILE,), tl.int32))
        q_lo, q_hi = fake_quantize_halves(lo, hi, amax, FOUR_OVER_SIX, SCALE_MAX)
        q_lo = cast_rne(q_lo, q_ptr)
        q_hi = cast_rne(q_hi, q_ptr)
        base = q_ptr + rows.to(tl.int64)[:, None, None] * K
        for j in range(J):  # an output per sibling, each to get its own channels back
            out = base + j * QS
            if KEEP:  # x's own values (exact in its dtype) at the kept channels
                keep = keep_ptr + (j * G + g).to(tl.int64) * K
                keep_lo = tl.load(keep + col_lo, mask=col_lo < K, other=0) != 0
                keep_hi = tl.load(keep + col_lo + 8, mask=col_lo + 8 < K, other=0) != 0
                tl.store(out + col_lo, tl.where(keep_lo, cast_rne(lo, q_ptr), q_lo),
                         mask=mask_lo)
                tl.store(out + col_lo + 8, tl.where(keep_hi, cast_rne(hi, q_ptr), q_hi),
                         mask=mask_hi)
            else:
                tl.store(out + col_lo, q_lo, mask=mask_lo)
                tl.store(out + col_lo + 8, q_hi, mask=mask_hi)
        if not KEEP:
            # The residual in x's dtype (torch's x - Q(x)), then float32 squares.
            r_lo = cast_rne(lo - q_lo.to(tl.float32), q_ptr).to(tl.float32)
            r_hi = cast_rne(hi - q_hi.to(tl.float32), q_ptr).to(tl.float32)
            acc_lo += tl.sum(tl.where(mask_lo, r_lo * r_lo, 0.0), axis=0)
            acc_hi += tl.sum(tl.where(mask_hi, r_hi * r_hi, 0.0), axis=0)
    if not KEEP:
        cols = kbs[:, None] * 16 + tl.arange(0, 8)[None, :]
        out = g.to(tl.int64) * K + cols
        tl.store(sums_ptr + out, acc_lo, mask=cols < K)
        tl.store(sums_ptr + out + 8, acc_hi, mask=cols + 8 < K)


@triton.jit
def select_kernel(sums_ptr, norms_ptr, x_ptr, q_ptr, rows_ptr, tile_group_ptr, R, K, sxm, DIV,
                  COUNT, G, QS, TILE: tl.constexpr, BLOCK: tl.constexpr, SORTED: tl.constexpr):
    """For the rows of tile program_id(0) (group tile_group[t] if SORTED, else 0; -1: none) and
    output j = program_id(1): q[j, r, c] = x[r // DIV, c] at the COUNT columns c of highest
    energy sums[g, c] * norms[j, g, c]."""
    t = tl.program_id(0)
    j = tl.program_id(1)
    if SORTED:  # noqa: SIM108
        g = tl.load(tile_group_ptr + t)
    else:
        g = t * 0
    cols = tl.arange(0, BLOCK)
    ok = cols < tl.where(g >= 0, K, 0)  # an unused tile (-1) chooses nothing
    row_g = g.to(tl.int64) * K + cols
    v = (tl.load(sums_ptr + row_g, mask=ok, other=0.0)
         * tl.load(norms_ptr + (j * G).to(tl.int64) * K + row_g, mask=ok, other=0.0))
    chosen = top_k_mask(v, ok, COUNT)
    q_ptr += j * QS
    if SORTED:  # noqa: SIM108 (padding slots hold R: masked below)
        n_slots = TILE
    else:  # the tile's rows that exist (a decoding step's one row, not 16)
        n_slots = tl.minimum(TILE, R - t * TILE)
    for i in range(n_slots):
        slot = t * TILE + i
        if SORTED:  # noqa: SIM108
            row = tl.load(rows_ptr + slot)
        else:
            row = slot
        m = chosen & (cols * 0 + row < R)
        xv = tl.load(x_ptr + (row // DIV).to(tl.int64) * sxm + cols, mask=m)
        tl.store(q_ptr + row.to(tl.int64) * K + cols, xv, mask=m)


def operand_supported(spec: QuantSpec, k: int) -> bool:
    """Whether `compensated_operand` computes x~ for activations of spec `spec` and K = k:
    NVFP4 1x16 round-to-nearest (Four Over Six and per-row amax allowed), K up to MAX_LENGTH."""
    return rows_fake_quantize_supported(spec) and 0 < k <= MAX_LENGTH


def row_splits(rows: int, alignment, static: bool) -> int:
    """How many programs share a group's row tiles in `quantize_energy_kernel`: 1 unless the
    channels are static; then for a dense layer of `rows` rows a tile each, for a grouped MoE
    (whose tiles per expert the host does not know without a sync) its tiles' mean per expert;
    at most MAX_ROW_SPLITS."""
    if not static:
        return 1
    if alignment is None:
        return max(1, min(MAX_ROW_SPLITS, cdiv(rows, DENSE_TILE)))
    n_tiles, n_groups = alignment.tile_expert.numel(), alignment.expert_tiles.numel() - 1
    return max(1, min(MAX_ROW_SPLITS, cdiv(n_tiles, max(1, n_groups))))


def compensated_operand(x: torch.Tensor, spec: QuantSpec, count: int,
                        norms: torch.Tensor | None, *, amax: torch.Tensor | None = None,
                        alignment=None, row_div: int = 1,
                        keep: torch.Tensor | None = None) -> torch.Tensor:
    """x~ in x's dtype (see the module doc), no host sync.

    keep (static channels, calibrated): bool masks in the place of `norms` ([K], [J, K] or
    [E, K]), True where x~ takes x; then x~ is one launch, with no energies and no choice
    (count and norms are not read).

    Dense (alignment None): x [M, K] is one group; norms [K] = ||Q(W)[:, c]||², or [J, K] for J
    sibling weights of this input (then the result is [J, M, K], an x~ per sibling); amax an
    imposed 0-d global amax (a static activation amax) or None (x's own: the tensor's, or each
    row's for a row-scaled spec). Returns [M, K].
    Grouped: `alignment` (moe_align.Alignment) puts the token-expert pairs p in tiles by expert;
    pair p reads x[p // row_div]; norms [E, K] per expert; amax [E] each expert's over its rows,
    or None for a row-scaled spec (each row's own). Returns [pairs, K] in pair order.
    """
    k = x.shape[-1]
    static = keep is not None
    if not operand_supported(spec, k):
        raise ValueError(f"compensated_operand: spec {spec} with K={k} is not supported; it "
                         f"takes NVFP4 1x16 round-to-nearest specs, K <= {MAX_LENGTH}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    kb = ENERGY_BLOCKS
    col_programs = cdiv(cdiv(k, 16), kb)
    # Static channels need no sums over the rows, so a group's row tiles are shared out over a
    # third grid axis instead of walked by one program (dynamic ones keep one walk, in order).
    splits = row_splits(x.shape[0], alignment, static)
    here = False
    if spec.row_scaled:
        if amax is not None:
            raise ValueError("compensated_operand: a row-scaled spec takes each row's own amax; "
                             "pass amax=None")
        # Each program reads its rows whole; a small operand's programs compute their amax.
        here = amax_here(x.numel(), col_programs)
    elif amax is None:
        if alignment is not None:
            raise ValueError("compensated_operand: grouped rows need each expert's amax")
        here = amax_here(x.numel(), col_programs * splits)  # each reads the whole of x
    if here:
        amax = x  # not read
    elif amax is None:
        amax = _amax(x.reshape(1, -1, k), spec)
    amax = amax if here else amax.to(torch.float32).contiguous()
    sorted_ = alignment is not None
    per_channel = keep if keep is not None else norms  # [K], [J, K] or [E, K]
    if per_channel is None or per_channel.shape[-1] != k:
        raise ValueError(f"compensated_operand: norms or keep must end in K={k}, got "
                         f"{None if per_channel is None else tuple(per_channel.shape)}")
    siblings = not sorted_ and per_channel.dim() == 2
    if sorted_:
        rows, tiles, groups = alignment.pairs, alignment.expert_tiles, alignment.tile_expert
        sorted_rows, tile, n_tiles = alignment.sorted_rows, alignment.block_m, groups.numel()
        n_groups, outputs = per_channel.shape[0], 1
    else:
        rows, tile = x.shape[0], DENSE_TILE
        n_tiles, n_groups = cdiv(rows, tile), 1
        outputs = per_channel.shape[0] if siblings else 1
        sorted_rows = tiles = groups = amax  # not read
    if outputs * rows * k >= 1 << 31:
        raise ValueError(f"compensated_operand: {outputs} x [{rows}, {k}] outputs are past the "
                         "kernels' 32-bit offsets; split the rows")
    q = torch.empty((outputs, rows, k), dtype=x.dtype, device=x.device)
    shape = q.shape if siblings else q.shape[1:]
    if rows == 0:
        return q.reshape(shape)
    if static:
        keep = sums = keep.contiguous().view(torch.uint8)  # bool as bytes; sums not written
    else:
        keep = sums = torch.empty((n_groups, k), dtype=torch.float32, device=x.device)
    quantize_energy_kernel[(n_groups, col_programs, splits)](
        x, amax, sorted_rows, tiles, q, sums, keep, rows, k, x.stride(0),
        row_div, n_tiles, outputs, rows * k, n_groups, TILE=tile, KB=kb, SORTED=sorted_,
        ROW_AMAX=spec.row_scaled, FOUR_OVER_SIX=spec.four_over_six, SCALE_MAX=spec.scale_max,
        AMAX_HERE=here, KEEP=static, num_warps=4, **_launch_options(),
    )
    if count > 0 and not static:
        block = triton.next_power_of_2(k)
        select_kernel[(n_tiles, outputs)](
            sums, norms.contiguous(), x, q, sorted_rows, groups, rows, k, x.stride(0), row_div,
            min(count, k), n_groups, rows * k, TILE=tile, BLOCK=block, SORTED=sorted_,
            num_warps=min(16, max(4, block // 1024)), **_launch_options(),
        )
    return q.reshape(shape)
