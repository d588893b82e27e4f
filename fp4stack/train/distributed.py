"""torch.distributed for the trainer: process group, device, DDP / FSDP2 wrapping, reductions.

Launched by torchrun (WORLD_SIZE > 1 in the environment) the trainer joins a process group:
NCCL with one GPU per process on CUDA, gloo on CPU. A single process never touches
torch.distributed, so the plain path has no distributed code in it at all.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..device import resolve_device
from .config import check_gather


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_group: bool  # this process created the process group, so it destroys it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def setup(device_name: str, timeout: datetime.timedelta | None = None) -> DistEnv:
    """Join the torchrun process group if there is one (or reuse an initialised one); `timeout`
    bounds how long a collective may wait (None: torch's default)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    if world <= 1:
        return DistEnv(0, 1, 0, resolve_device(device_name, local_rank=0), owns_group=False)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name, local_rank)
    owns = not dist.is_initialized()
    if owns:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None,
                                **({} if timeout is None else {"timeout": timeout}))
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, owns)


def teardown(env: DistEnv, synchronize: bool = False) -> None:
    """Leave the process group this process created. synchronize: first wait for every rank
    (a run that ended well), so that no rank closes its connections while another still
    talks over them; after an error no rank waits for the others."""
    if env.owns_group and dist.is_initialized():
        if synchronize and env.distributed:
            # A rank that failed has left without waiting: its own error reports the run.
            with contextlib.suppress(RuntimeError):
                barrier(env)
        dist.destroy_process_group()


@contextlib.contextmanager
def process_group(device_name: str, timeout: datetime.timedelta | None = None
                  ) -> Iterator[DistEnv]:
    """`setup` on entry and `teardown` on exit: synchronized when the block ends normally."""
    env = setup(device_name, timeout)
    try:
        yield env
    except BaseException:
        teardown(env)
        raise
    teardown(env, synchronize=True)


def barrier(env: DistEnv) -> None:
    if env.distributed:
        if env.device.type == "cuda":
            dist.barrier(device_ids=[env.device.index])
        else:
            dist.barrier()


def all_reduce_mean(values: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Mean over ranks of a (small) tensor; the identity in a single process."""
    if env.distributed:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values /= env.world_size
    return values


def all_reduce_sum(values: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.distributed:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def gather_to_main(obj: object, env: DistEnv) -> list[object] | None:
    """Every rank's picklable `obj`, in rank order, on the main rank (None elsewhere); [obj]
    in a single process."""
    if not env.distributed:
        return [obj]
    out = [None] * env.world_size if env.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def wrap(model: nn.Module, mode: str, env: DistEnv, gather: str = "fp32") -> nn.Module:
    """DDP, or FSDP2 (`fully_shard` on every transformer block, then on the root).

    FSDP2 keeps fp32 parameters and all-gathers them in fp32; bf16 compute comes from autocast,
    as in the single-process and DDP paths, so every mode quantizes the same fp32 master weights.
    gather="nvfp4": the blocks' FP4 linear weights are all-gathered as NVFP4 bytes instead, the
    same values (train/fsdp_nvfp4.py); the layers it cannot take keep fp32, listed on rank 0.
    """
    check_gather(gather, mode)
    if not env.distributed:
        return model
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [env.device.index] if env.device.type == "cuda" else None
        return DDP(model, device_ids=ids)
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # The mesh on the run's device type: by default FSDP2 takes the machine's accelerator,
        # which a CPU (gloo) run on a GPU machine must not touch.
        mesh = init_device_mesh(env.device.type, (env.world_size,))
        left: dict[str, str] = {}
        if gather == "nvfp4":
            from . import fsdp_nvfp4

            # Only the blocks' layers: FSDP2 reshards a block after its forward, so the amaxes
            # are refreshed from sharded rows; the root's own parameters may stay unsharded.
            for i, block in enumerate(model.model.layers):
                left |= {f"model.layers.{i}.{k}": v
                         for k, v in fsdp_nvfp4.enable(block, env.world_size).items()}
        for block in model.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if gather == "nvfp4":
            fsdp_nvfp4.install(model, mesh.get_group())
            if env.is_main:
                n = sum(getattr(m, "nvfp4_gather", None) is not None for m in model.modules())
                why = Counter(left.values())
                print(f"fsdp2: {n} linear weights of the blocks all-gathered in NVFP4"
                      + "".join(f"; {k} in fp32: {r}" for r, k in why.items()), flush=True)
        return model
    raise ValueError(f"distributed must be ddp or fsdp2, got {mode!r}")


def unwrap(model: nn.Module) -> nn.Module:
    """The GPT inside a DDP wrapper (FSDP2 modifies the model in place: nothing to unwrap)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return model.module if isinstance(model, DDP) else model
