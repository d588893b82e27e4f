"""distributed.process_group: every rank leaves the group; only a run that ended well waits
for the others first, so a failed rank neither hangs nor hides its error."""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp4stack.train import distributed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, fail_rank: int, results) -> None:
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    outcome = "ended"
    try:
        with distributed.process_group("cpu", timeout=datetime.timedelta(seconds=30)) as env:
            assert env.world_size == 2 and env.rank == rank and dist.is_initialized()
            assert distributed.all_reduce_sum(torch.ones(1), env).item() == 2
            if rank == fail_rank:
                raise ValueError("this rank failed")
    except ValueError as e:
        outcome = str(e)
    results.put((rank, outcome, dist.is_initialized()))


@pytest.mark.parametrize("fail_rank", [-1, 0, 1])
def test_every_rank_leaves_the_group_and_a_failure_is_its_own(fail_rank):
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(free_port(), fail_rank, results), nprocs=2,
                       start_method="spawn")
    got = sorted(results.get() for _ in range(2))
    assert got == [(r, "this rank failed" if r == fail_rank else "ended", False)
                   for r in range(2)]


def test_one_process_has_no_group():
    with distributed.process_group("cpu") as env:
        assert not env.distributed and not dist.is_initialized()
