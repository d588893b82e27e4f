"""ShardLocal in one process: over plain tensors it is its inner optimizer (the rank's seed
folded in), its state round-trips, and another rank's state is refused. The two-rank FSDP2 run
is in test_distributed.py."""

from __future__ import annotations

import pytest
import torch

from fp4stack.formats.random import stream_seed
from fp4stack.optim import AdamW4
from fp4stack.optim.shard_local import ShardLocal


def params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(64, 128, generator=g)),
            torch.nn.Parameter(torch.randn(128, generator=g))]


def run(opt, ps, steps: int = 3, start: int = 0) -> None:
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(100 + step)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        for group in opt.param_groups:
            group["lr"] = 1e-2 / (1 + step)  # as set_lr does before every step
        opt.step()
        opt.zero_grad()


def make(groups):
    return AdamW4(groups, lr=1e-2, min_numel=1024)


def test_over_plain_tensors_it_is_the_inner_optimizer():
    a, b = params(), params()
    run(ShardLocal([{"params": a, "seed": 5}], make, rank=1, world_size=2), a)
    run(AdamW4([{"params": b, "seed": stream_seed(5, 1) >> 2}], lr=1e-2, min_numel=1024), b)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_state_round_trip_and_refusals():
    a, b = params(), params()
    opt = ShardLocal([{"params": a, "seed": 0}], make, rank=0, world_size=2)
    run(opt, a, steps=2)
    sd = opt.state_dict()
    assert sd["rank"] == 0 and sd["world_size"] == 2
    assert "exp_avg_sq_data" in sd["inner"]["state"][0]  # the matrix's moments are NVFP4
    for p, q in zip(a, b, strict=True):
        q.data.copy_(p.data)
    again = ShardLocal([{"params": b, "seed": 0}], make, rank=0, world_size=2)
    again.load_state_dict(sd)  # before its first step: applied when it builds
    run(opt, a, steps=2, start=2)
    run(again, b, steps=2, start=2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    other = ShardLocal([{"params": params(), "seed": 0}], make, rank=1, world_size=2)
    with pytest.raises(ValueError, match="rank 0 of 2, not rank 1 of 2"):
        other.load_state_dict(sd)
