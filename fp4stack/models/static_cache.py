"""A fixed-size KV cache for decoding with static shapes (what CUDA graph replay needs).

`KVCache` grows: each step attends over one more column and slices a new view, so every step has
other shapes. Here each layer's keys and values live in buffers [B, Hkv, L, hd] allocated once;
a step writes its column at a device-side index (`column`, one tensor shared by all layers and
advanced on the device) and attends over all L columns, with a boolean "may attend" mask built
on the device from which columns hold real tokens. Nothing a step does depends on a host value,
so one captured step serves every position.
"""

from __future__ import annotations

import torch
from torch import Tensor


class StaticKVCache:
    """One layer's keys and values in preallocated buffers k, v [B, Hkv, L, hd].

    `update` (the interface Attention calls) writes the new columns at `column` ([S] long, on the
    device, shared by every layer) and returns the whole buffers. Columns not written in this
    sequence hold stale values: the caller's mask must exclude them (`decode_mask` does).
    """

    def __init__(self, batch: int, max_len: int, n_kv_heads: int, head_dim: int,
                 column: Tensor, dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.column = column
        self.max_len = max_len

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [B, Hkv, S, hd] at columns `column`; return the full k, v buffers."""
        self.k.index_copy_(2, self.column, k.to(self.k.dtype))
        self.v.index_copy_(2, self.column, v.to(self.v.dtype))
        return self.k, self.v

    def load(self, k: Tensor, v: Tensor) -> None:
        """Copy a prefill's k, v [b, Hkv, P, hd] into rows [:b], columns [:P]."""
        b, _, p, _ = k.shape
        self.k[:b, :, :p].copy_(k)
        self.v[:b, :, :p].copy_(v)

    def zero_(self) -> None:
        """Clear both buffers (a NaN left by an earlier sequence would poison P @ V even where
        the mask gives it weight 0, since 0 * NaN is NaN)."""
        self.k.zero_()
        self.v.zero_()


def decode_mask(real: Tensor, column: Tensor) -> Tensor:
    """The "may attend" mask [B, 1, 1, L] of one query at `column` ([1] long): the real keys
    (real [B, L] bool, which is False past the column) and the query's own key, so a pad query
    still attends to something, as `padded_causal_mask` does."""
    cols = torch.arange(real.shape[1], device=real.device)
    return (real | (cols == column)[None, :])[:, None, None, :]
