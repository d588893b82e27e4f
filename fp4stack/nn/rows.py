"""A weight from its ranks' rows, for the layers whose FSDP2 all-gather delivers Q(W) instead of
W (train/fsdp_nvfp4.py): where a recipe reads W itself (a low-rank refit, a forward switched to
high precision) it all-gathers the fp32 rows. Process groups are registered here by a key the
caller keeps (an int, which a custom op's schema can carry), not held by the layers, which
torch.compile guards on and cannot copy a process group into."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_GROUPS: dict[int, Any] = {}


def register_group(key: int, group: Any) -> None:
    """Name `group` (a torch.distributed process group, None for the default) by `key`."""
    _GROUPS[key] = group


@torch.no_grad()
def gather_rows(rows: torch.Tensor, shards: int, key: int) -> torch.Tensor:
    """The [shards * n, ...] tensor whose rows are each rank's `rows` [n, ...] in rank order,
    over the process group registered as `key`."""
    rows = rows.detach().contiguous()
    out = rows.new_empty((rows.shape[0] * shards, *rows.shape[1:]))
    # all_gather_single is all_gather_into_tensor's newer name (the old one warns in 2.13)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, rows, group=_GROUPS.get(key))
    return out
