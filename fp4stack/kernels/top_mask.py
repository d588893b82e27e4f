"""The k largest entries of a vector as a mask, in one launch with no host sync: QUADS's choice
of compensation channels during decoding, where `torch.topk` + sort + searchsorted cost several
launches and tens of microseconds a layer.

The rule is `nn.compensation.top_channels`'s: the k largest values, ties at the k-th taken
lowest index first (a stable descending sort's first k). Values are compared as their float32
bit patterns read as unsigned integers, which orders every value >= +0 as the floats do, and
puts NaN above +inf (where torch's sort puts it too). Energies are sums of squares, never
negative; negative inputs would order above the positive ones, so they are not for this. One
program: the vector sits in registers, its k-th largest bit pattern is found 4 bits at a time
(a radix select: 8 rounds of a 16-bin histogram, where a binary search took 32 rounds of a
block-wide count, each a barrier), and the ties by one prefix sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .nvfp4 import _launch_options

MAX_LENGTH = 1 << 15  # one program holds the vector in registers


@triton.jit
def top_k_mask(v, ok, K):
    """v[i] is among the K largest of v[ok] (ties lowest index first; 0 < K): the entries
    outside `ok` never count and are never chosen. v: float32 values >= +0 (or NaN)."""
    bits = v.to(tl.uint32, bitcast=True)
    # The largest pattern t with at least K entries >= t is the K-th largest. Its bits are
    # fixed 4 at a time, highest first: with t's higher bits fixed, an entry whose higher
    # bits equal t's counts in the bin of its next 4 bits, one whose higher bits exceed t's
    # in the top bin (it is >= every candidate), one below in none. The number of entries
    # >= t | (j << s) is then the count of bins j..15; t takes the largest j where that is
    # still >= K (j = 0 always qualifies: t's own count is >= K).
    t = tl.full((), 0, tl.uint32)
    bins = tl.arange(0, 16)
    for s in tl.static_range(28, -1, -4):
        digit = ((bits >> s) & 15).to(tl.int32)
        if s == 28:  # no higher bits yet
            live = ok
        else:
            high = bits >> (s + 4)
            above = high > (t >> (s + 4))
            digit = tl.where(above, 15, digit)
            live = ok & (above | (high == (t >> (s + 4))))
        hist = tl.histogram(digit, 16, mask=live)
        at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # entries in bins >= j
        j = tl.sum(((at_least >= K) & (bins > 0)).to(tl.int32), axis=0)
        t = t | (j.to(tl.uint32) << s)
    above = ok & (bits > t)
    tie = ok & (bits == t)
    need = K - tl.sum(above.to(tl.int32), axis=0)
    rank = tl.cumsum(tie.to(tl.int32), axis=0)  # 1 for the first tie
    return above | (tie & (rank <= need))


@triton.jit
def top_mask_kernel(v_ptr, out_ptr, N, K, BLOCK: tl.constexpr):
    """out[i] = v[i] is among the K largest of v[:N] (ties lowest index first); 0 < K <= N."""
    i = tl.arange(0, BLOCK)
    ok = i < N
    v = tl.load(v_ptr + i, mask=ok, other=0.0)
    tl.store(out_ptr + i, top_k_mask(v, ok, K), mask=ok)


def top_mask(values: torch.Tensor, k: int) -> torch.Tensor:
    """bool [N]: True at the k largest entries of the float32 vector `values` [N] (values >= +0;
    ties lowest index first: the first k of a stable descending sort). One Triton launch up to
    MAX_LENGTH entries, a stable sort above; k <= 0 gives no entry, k >= N every one."""
    if values.dim() != 1 or values.dtype != torch.float32:
        raise ValueError(f"top_mask: values must be a float32 vector, got {values.dtype} "
                         f"{tuple(values.shape)}")
    n = values.numel()
    if k <= 0 or n == 0:
        return torch.zeros(n, dtype=torch.bool, device=values.device)
    if k >= n:
        return torch.ones(n, dtype=torch.bool, device=values.device)
    if n > MAX_LENGTH:
        return stable_top_mask(values, k)
    out = torch.empty(n, dtype=torch.bool, device=values.device)
    block = triton.next_power_of_2(n)
    top_mask_kernel[(1,)](values.contiguous(), out, n, k, BLOCK=block,
                          num_warps=min(16, max(4, block // 1024)), **_launch_options())
    return out


def stable_top_mask(values: torch.Tensor, k: int) -> torch.Tensor:
    """The same mask by torch: the first k of a stable descending sort."""
    order = torch.sort(values, descending=True, stable=True).indices[:k]
    mask = torch.zeros(values.numel(), dtype=torch.bool, device=values.device)
    return mask.index_fill_(0, order, True)
