"""Validation loss: the same held-out windows for every recipe, shared out over the ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..data.shards import TokenShards
from . import distributed
from .config import PretrainConfig
from .distributed import DistEnv


def val_chunks(val: TokenShards, cfg: PretrainConfig, env: DistEnv
               ) -> list[tuple[torch.Tensor, bool]]:
    """This rank's share of the fixed validation windows: (chunk [rows, seq_len + 1], counted).

    The windows are eval_batches micro-batches of micro_batch_size sequences from the start of
    the split, whatever the world size; rank r takes micro-batches r, r + world, ...: the very
    forwards a single process runs (an FP4 forward's activation scales depend on all its rows,
    so the loss is the same on any number of ranks, up to the order of the final sum). Every
    rank runs the same number of forwards, as FSDP2 requires: a rank one short repeats the
    first micro-batch, not counted.
    """
    batches = [torch.cat((x, y[:, -1:]), dim=1)
               for x, y in val.val_batches(cfg.micro_batch_size, cfg.seq_len, cfg.eval_batches)]
    mine = batches[env.rank::env.world_size]
    rounds = -(-len(batches) // env.world_size)
    return [(w, True) for w in mine] + [(batches[0], False)] * (rounds - len(mine))


@torch.no_grad()
def evaluate(model: nn.Module, chunks: list[tuple[torch.Tensor, bool]], env: DistEnv,
             autocast) -> float:
    """Mean next-token cross-entropy (no MoE aux loss) over all ranks' validation windows."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=env.device)
    # Evaluation must not move the RNG streams training draws from (stochastic rounding).
    with torch.random.fork_rng(devices=[env.device] if env.device.type == "cuda" else []):
        for w, counted in chunks:
            w = w.to(env.device)
            with autocast:
                logits, _ = model(w[:, :-1])
            if not counted:
                continue
            ce = F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(),
                                 reduction="sum")
            total[0] += ce.double()
            total[1] += w[:, 1:].numel()
    model.train()
    total = distributed.all_reduce_sum(total, env)
    return (total[0] / total[1]).item()
