"""The grouped MoE path: token-expert pairs sorted by expert into padded tiles, two grouped GEMM
launches (gate/up, down) for all experts, and the combine, all without a host sync.

Pair p = t * k + j is token t's j-th choice. `align_pairs` sorts the T*k pairs by expert and
pads each expert's run to whole tiles of block_m rows; the number of tiles has a static bound
(T*k // block_m + min(E, T*k)), so every shape is known on the host without reading the routing
back, and tiles past the last expert's are skipped by the kernel. The alignment is one Triton
launch (`align_pairs_kernel`: a counting sort, each pair's row written once) where the torch
reference (`align_pairs_reference`: sorts, gathers and searchsorted) takes ~30 small launches a
MoE block, which a decoding step of a narrow MoE pays in every block. Nothing here uses atomics:
deterministic run to run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..formats.fp8 import fake_quantize_fp8
from ..formats.spec import QuantSpec
from . import interpreted
from .compensation import compensated_operand
from .expert_order import expert_order
from .nvfp4 import _launch_options, fake_quantize
from .packed_gemm import (
    PackedExperts,
    choose_grouped_config,
    grouped_gemm,
    rows_fake_quantize,
)


@dataclass(frozen=True)
class Alignment:
    """Pairs grouped by expert into tiles of block_m rows.

    sorted_rows: int32 [n_tiles * block_m], the pair of each row (`pairs` for padding); an
                 expert's pairs are in increasing order.
    tile_expert: int32 [n_tiles], the expert of each tile; -1 for the unused tiles at the end.
    expert_tiles: int32 [E + 1], expert e's tiles are expert_tiles[e] .. expert_tiles[e + 1].
    """

    sorted_rows: torch.Tensor
    tile_expert: torch.Tensor
    expert_tiles: torch.Tensor
    pairs: int
    block_m: int


def max_tiles(pairs: int, n_experts: int, block_m: int) -> int:
    """An upper bound on sum_e ceil(count_e / block_m): each expert with pairs adds at most one
    partial tile to the pairs // block_m full ones, and at most min(E, pairs) experts have any."""
    return pairs // block_m + min(n_experts, pairs)


MAX_KERNEL_EXPERTS = 256  # the kernel holds a [pairs, experts] block of comparisons


def align_pairs(indices: torch.Tensor, n_experts: int, block_m: int) -> Alignment:
    """Sort the pairs of routing `indices` [T, k] (expert ids in [0, n_experts)) by expert into
    tiles of block_m rows, each tile holding one expert's pairs (see Alignment): one Triton
    launch on CUDA (and under the interpreter), the torch reference elsewhere; the same
    Alignment either way."""
    if (indices.numel() and n_experts <= MAX_KERNEL_EXPERTS
            and (indices.is_cuda or interpreted())):
        return _align_pairs_triton(indices, n_experts, block_m)
    return align_pairs_reference(indices, n_experts, block_m)


@triton.jit
def align_pairs_kernel(ids_ptr, rows_ptr, tile_expert_ptr, expert_tiles_ptr, P, E, N_TILES,
                       block_m, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):
    """One program: count each expert's pairs, lay the tiles out, then write pair p to row
    tile_start[e] * block_m + (pairs of e before p); rows no pair takes hold P."""
    e = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), tl.int32)
    for start in range(0, P, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        ids = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
    tiles = (counts + block_m - 1) // block_m
    tile_end = tl.cumsum(tiles, axis=0)
    row_start = (tile_end - tiles) * block_m
    tl.store(expert_tiles_ptr + e, tile_end - tiles, mask=e < E)
    tl.store(expert_tiles_ptr + 1 + e, tile_end, mask=e == E - 1)
    # A tile's expert: the first whose tiles end after it (-1 past the last expert's tiles).
    for start in range(0, N_TILES, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        owner = tl.sum(((tile_end[None, :] <= t[:, None]) & (e[None, :] < E)).to(tl.int32),
                       axis=1)
        tl.store(tile_expert_ptr + t, tl.where(owner < E, owner, -1), mask=t < N_TILES)
    for start in range(0, N_TILES * block_m, BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)
        tl.store(rows_ptr + r, tl.zeros((BLOCK_R,), tl.int32) + P, mask=r < N_TILES * block_m)
    tl.debug_barrier()  # the padding is written before any pair's row
    seen = tl.zeros((BLOCK_E,), tl.int32)  # each expert's pairs in the blocks before
    for start in range(0, P, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        ids = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
        hit = (ids[:, None] == e[None, :]).to(tl.int32)
        before = tl.cumsum(hit, axis=0) - hit + seen[None, :]  # earlier pairs of each expert
        row = tl.sum(hit * (row_start[None, :] + before), axis=1)
        tl.store(rows_ptr + row, p.to(tl.int32), mask=p < P)
        seen += tl.sum(hit, axis=0)


def _align_pairs_triton(indices: torch.Tensor, n_experts: int, block_m: int) -> Alignment:
    flat = indices.reshape(-1).contiguous()
    pairs = flat.numel()
    n_tiles = max_tiles(pairs, n_experts, block_m)
    sorted_rows = torch.empty(n_tiles * block_m, dtype=torch.int32, device=flat.device)
    tile_expert = torch.empty(n_tiles, dtype=torch.int32, device=flat.device)
    expert_tiles = torch.empty(n_experts + 1, dtype=torch.int32, device=flat.device)
    block_e = max(2, triton.next_power_of_2(n_experts))
    block_p = max(16, min(triton.next_power_of_2(pairs), 4096 // block_e))
    align_pairs_kernel[(1,)](flat, sorted_rows, tile_expert, expert_tiles, pairs, n_experts,
                             n_tiles, block_m, BLOCK_P=block_p, BLOCK_E=block_e,
                             BLOCK_T=max(16, 4096 // block_e), BLOCK_R=1024, num_warps=4,
                             **_launch_options())
    return Alignment(sorted_rows, tile_expert, expert_tiles, pairs, block_m)


def align_pairs_reference(indices: torch.Tensor, n_experts: int, block_m: int) -> Alignment:
    """`align_pairs` in torch: sorts, gathers and searchsorted (the kernel's reference)."""
    flat = indices.reshape(-1).long()
    pairs, dev = flat.numel(), flat.device
    n_tiles = max_tiles(pairs, n_experts, block_m)
    order = expert_order(flat, n_experts)  # pairs by expert, in pair order within one
    experts = torch.arange(n_experts + 1, device=dev)
    bounds = torch.searchsorted(flat[order], experts)  # expert e's pairs: order[bounds[e]:...]
    start, counts = bounds[:-1], bounds[1:] - bounds[:-1]
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    padded_end = tile_end * block_m
    padded_start = padded_end - tiles * block_m
    rows = torch.arange(n_tiles * block_m, device=dev)
    row_expert = torch.searchsorted(padded_end, rows, right=True)  # n_experts past the end
    e = row_expert.clamp(max=n_experts - 1)
    rank = rows - padded_start[e]
    valid = (row_expert < n_experts) & (rank < counts[e])
    src = (start[e] + rank).clamp(max=max(pairs - 1, 0))
    sorted_rows = torch.where(valid, order[src], pairs).to(torch.int32)
    tile_expert = row_expert[::block_m]
    tile_expert = torch.where(tile_expert < n_experts, tile_expert, -1).to(torch.int32)
    expert_tiles = F.pad(tile_end, (1, 0)).to(torch.int32)
    return Alignment(sorted_rows, tile_expert, expert_tiles, pairs, block_m)


def group_amax(rows: torch.Tensor, row_div: int, group: torch.Tensor,
               n_groups: int) -> torch.Tensor:
    """float32 [n_groups]: per group g, max |x| over the pairs p of g of rows[p // row_div], NaN
    when any is (torch.amax's rule); 0 for an empty group. One Triton launch (and a zeroed
    output) on CUDA and under the interpreter, where the torch form (`group_amax_reference`)
    takes nine: each row's maximum as an integer over the float32 bits with the sign cleared
    (ordered like |x|, NaN above inf), added to its pairs' groups by an atomic max, which
    gives the same result in any order."""
    n = rows.shape[0]
    if not (n and (rows.is_cuda or interpreted())):
        return group_amax_reference(rows, row_div, group, n_groups)
    out = torch.zeros(n_groups, dtype=torch.int32, device=rows.device)
    d = rows.shape[-1]
    group_amax_kernel[(n,)](rows.contiguous(), group.reshape(-1).contiguous(), out, d,
                            ROW_DIV=row_div, BLOCK_D=min(1024, triton.next_power_of_2(d)),
                            num_warps=4, **_launch_options())
    return out.view(torch.float32)


@triton.jit
def group_amax_kernel(x_ptr, group_ptr, bits_ptr, D, ROW_DIV: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    """bits[group[r * ROW_DIV + j]] = max(itself, bits of max |x[r]|) for j < ROW_DIV."""
    r = tl.program_id(0).to(tl.int64)
    best = tl.zeros((BLOCK_D,), tl.int32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        v = tl.load(x_ptr + r * D + d, mask=d < D, other=0.0).to(tl.float32)
        best = tl.maximum(best, v.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    row_max = tl.max(best, axis=0)
    for j in tl.static_range(ROW_DIV):
        tl.atomic_max(bits_ptr + tl.load(group_ptr + r * ROW_DIV + j), row_max)


def group_amax_reference(rows: torch.Tensor, row_div: int, group: torch.Tensor,
                         n_groups: int) -> torch.Tensor:
    """`group_amax` in torch: through a [pairs, n_groups] mask rather than a scatter, so
    exact, deterministic, and allowed under torch's deterministic mode."""
    bits = rows.abs().amax(dim=-1).float().view(torch.int32) & 0x7FFFFFFF
    if row_div > 1:
        bits = bits[:, None].expand(-1, row_div).reshape(-1)
    mine = group.reshape(-1, 1) == torch.arange(n_groups, device=rows.device)
    out = torch.where(mine, bits[:, None], 0).amax(dim=0)
    return out.view(torch.float32)


MAX_COMBINE_K = 16  # the kernel ranks a token's k choices by a [k, k] comparison


def combine(y: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """float32 [T, D]: sum_j weights[t, j] * y[t * k + j], each product in float32 and the k
    terms added in increasing expert order, as Experts.forward's loop adds them (expert by
    expert into zeros), so equal y give equal bits. One Triton launch on CUDA (and under the
    interpreter), where the torch reference (`combine_reference`) takes seven; a token's
    experts are distinct, as top-k routing gives them (ties would be added in choice order)."""
    t, k = indices.shape
    if y.dim() != 2 or y.shape[0] != t * k or weights.shape != indices.shape:
        raise ValueError(f"combine: y {tuple(y.shape)} must be [T*k, D] and weights "
                         f"{tuple(weights.shape)} [T, k] for indices {tuple(indices.shape)}")
    if not (t and k <= MAX_COMBINE_K and (y.is_cuda or interpreted())):
        return combine_reference(y, weights, indices)
    d = y.shape[-1]
    out = torch.empty((t, d), dtype=torch.float32, device=y.device)
    block_d = min(1024, triton.next_power_of_2(d))
    combine_kernel[(t, triton.cdiv(d, block_d))](
        y.contiguous(), weights.contiguous(), indices.contiguous(), out, d, K=k,
        KP=max(2, triton.next_power_of_2(k)), BLOCK_D=block_d, num_warps=4, **_launch_options())
    return out


@triton.jit
def combine_kernel(y_ptr, gates_ptr, experts_ptr, sum_ptr, D, K: tl.constexpr,
                   KP: tl.constexpr, BLOCK_D: tl.constexpr):
    """sum[t, block] = (0 + p_(1)) + p_(2) + ..., p_(r) = float32(y[t * K + j]) * gates[t, j]
    for the choice j of rank r by its expert (experts[t, j]; ties: choice order); KP: K's
    next power of two."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = d < D
    j = tl.arange(0, KP)
    e = tl.load(experts_ptr + t * K + j, mask=j < K, other=0)
    # rank[j]: the choices before j in expert order (a lower expert, or the same one earlier)
    before = (e[None, :] < e[:, None]) | ((e[None, :] == e[:, None]) & (j[None, :] < j[:, None]))
    rank = tl.sum((before & (j[None, :] < K)).to(tl.int32), axis=1)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for r in tl.static_range(K):
        src = tl.sum(tl.where((rank == r) & (j < K), j, 0), axis=0)
        w = tl.load(gates_ptr + t * K + src).to(tl.float32)
        p = tl.load(y_ptr + (t * K + src) * D + d, mask=ok, other=0.0).to(tl.float32) * w
        acc = p + 0.0 if r == 0 else acc + p  # the loop's zeros + first term: -0.0 -> +0.0
    tl.store(sum_ptr + t * D + d, acc, mask=ok)


def combine_reference(y: torch.Tensor, weights: torch.Tensor,
                      indices: torch.Tensor) -> torch.Tensor:
    """`combine` in torch: products, a sort of each token's choices, a gather and k adds."""
    t, k = indices.shape
    prod = y.reshape(t, k, -1) * weights.reshape(t, k, 1).to(torch.float32)
    order = indices.argsort(dim=1)
    prod = prod.gather(1, order[:, :, None].expand_as(prod))
    out = prod[:, 0] + 0.0  # as the loop's zeros + first term: -0.0 becomes +0.0
    for j in range(1, k):
        out = out + prod[:, j]
    return out


def _operand(x: torch.Tensor, row_div: int, groups: torch.Tensor, n_experts: int,
             x_spec: QuantSpec | None, dtype: torch.dtype, al: Alignment,
             compensation: tuple[int, torch.Tensor] | None = None) -> tuple[torch.Tensor, int]:
    """(a, a_div) for a grouped GEMM whose row p multiplies x[p // row_div]: x itself in dtype,
    or for an NVFP4 x_spec each pair's row quantized with its expert's amax over the rows that
    expert receives (the reference's per-expert dynamic amax); a row-scaled x_spec quantizes
    each row of x once, with its own amax, which is the same for every expert it goes to.
    `compensation` (count, norms [E, K]): QUADS's x~ per pair, each expert's count channels of
    highest residual energy over its rows put back to x (kernels.compensation); (count, bool
    [E, K]): each expert's static channels put back."""
    if x_spec is None or x_spec.format == "none":
        return x.to(dtype), row_div
    if x_spec.format == "fp8":  # per row or 1x128 block: no expert's rows change another's
        if x_spec.fp8_granularity == "tensor":
            raise ValueError("grouped experts take FP8 activations scaled per row or per 1x128 "
                             "block, not per tensor (the loop's amax is each expert's)")
        q = fake_quantize_fp8(x, x_spec.fp8_granularity, nan_policy="propagate")
        return q.to(dtype), row_div
    spec = replace(x_spec, nan_policy="propagate")
    if compensation is not None:  # Q(x) and the residual in x's dtype, as the loop
        count, per_channel = compensation
        keep = per_channel if per_channel.dtype == torch.bool else None
        amax = None if spec.row_scaled else group_amax(x, row_div, groups, n_experts)
        a = compensated_operand(x, spec, count, None if keep is not None else per_channel,
                                amax=amax, alignment=al, row_div=row_div, keep=keep)
        return a.to(dtype), 1
    if x_spec.row_scaled:  # each token's own amax, whatever its expert: once per token
        return fake_quantize(x, spec, dtype=dtype), row_div
    amax = group_amax(x, row_div, groups, n_experts)
    return rows_fake_quantize(x, row_div, amax, groups, x_spec, dtype), 1


def grouped_mlp(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                gate_up: PackedExperts | torch.Tensor, down: PackedExperts | torch.Tensor,
                x_spec: QuantSpec | None = None, dtype: torch.dtype | None = None,
                compensation=None) -> torch.Tensor:
    """The SwiGLU experts of `Experts.forward` for x [T, D] routed by indices / weights [T, k]:
    float32 [T, D] = sum_j weights[:, j] * down_e(silu(gate_e(x)) * up_e(x)), e = indices[:, j].

    gate_up [E, 2I, D] and down [E, D, I]: PackedExperts or plain tensors. GEMMs in `dtype`
    (default x's) with float32 sums. x_spec (NVFP4, 1x16, RNE): each expert's input rows are
    quantized with the amax of the rows that expert receives, as the per-expert reference does.
    compensation: None, or per projection (count, column norms [E, K] of its packed weights):
    QUADS residual compensation of each expert's activations (see `_operand`).
    """
    dtype = dtype or x.dtype
    t, k = indices.shape
    n_experts = gate_up.shape[0]
    if t * k == 0:
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    cfg = choose_grouped_config(t * k, n_experts, dtype)
    al = align_pairs(indices, n_experts, cfg.block_m)
    groups = indices.reshape(-1)
    if not isinstance(gate_up, PackedExperts):
        gate_up, down = gate_up.to(dtype), down.to(dtype)
    comp_gu, comp_dn = compensation if compensation is not None else (None, None)
    a, a_div = _operand(x, k, groups, n_experts, x_spec, dtype, al, comp_gu)
    gu = grouped_gemm(a, a_div, gate_up, al.sorted_rows, al.tile_expert, al.pairs, cfg)
    gate, up = gu.chunk(2, dim=-1)
    h = F.silu(gate) * up
    h, h_div = _operand(h, 1, groups, n_experts, x_spec, dtype, al, comp_dn)
    y = grouped_gemm(h, h_div, down, al.sorted_rows, al.tile_expert, al.pairs, cfg)
    return combine(y, weights, indices)
