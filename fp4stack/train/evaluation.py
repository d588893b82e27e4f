"""Validation loss: the same held-out windows for every recipe, shared out over the ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..data.shards import TokenShards
from . import distributed
from .config import PretrainConfig
from .distributed import DistEnv


def val_chunks(val: TokenShards, cfg: PretrainConfig, env: DistEnv) -> list[torch.Tensor]:
    """This rank's share of the fixed validation windows, as [rows, seq_len + 1] chunks.

    The windows are eval_batches * micro_batch_size sequences from the start of the split,
    whatever the world size (trimmed to a multiple of it, so every rank runs the same number of
    forwards, as FSDP2 requires); rank r takes rows r::world of each chunk.
    """
    rows = torch.cat([torch.cat((x, y[:, -1:]), dim=1)
                      for x, y in val.val_batches(cfg.micro_batch_size, cfg.seq_len,
                                                  cfg.eval_batches)])
    n = len(rows) - len(rows) % env.world_size
    if n == 0:
        raise ValueError(f"validation split has {len(rows)} windows of seq_len {cfg.seq_len}, "
                         f"fewer than the {env.world_size} ranks")
    per = cfg.micro_batch_size * env.world_size
    return [rows[i:i + per][env.rank::env.world_size] for i in range(0, n, per)]


@torch.no_grad()
def evaluate(model: nn.Module, chunks: list[torch.Tensor], env: DistEnv, autocast) -> float:
    """Mean next-token cross-entropy (no MoE aux loss) over all ranks' validation windows."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=env.device)
    # Evaluation must not move the RNG streams training draws from (stochastic rounding).
    with torch.random.fork_rng(devices=[env.device] if env.device.type == "cuda" else []):
        for w in chunks:
            w = w.to(env.device)
            with autocast:
                logits, _ = model(w[:, :-1])
            ce = F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(),
                                 reduction="sum")
            total[0] += ce.double()
            total[1] += w[:, 1:].numel()
    model.train()
    total = distributed.all_reduce_sum(total, env)
    return (total[0] / total[1]).item()
