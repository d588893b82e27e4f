"""An element-wise optimizer over the local shards of FSDP2's parameters.

FSDP2 shards each parameter by rows (a DTensor, `Shard(0)`): rank r holds a block of rows and,
after the backward's reduce-scatter, the same rows of the gradient. An optimizer whose update of
an element reads only that element's history (AdamW, AdamW4) can step each rank's rows on their
own. `ShardLocal` does that for optimizers that do not know DTensors: it hands the inner
optimizer plain tensors aliasing each shard's storage, and the shard of the gradient before
every step. Its states are then sharded like the parameters: AdamW4's NVFP4 moments of a
rank's rows are their own NVFP4 tensors, with their own global scale, rank-1 factors and
stochastic-rounding seeds (the run's seed with the rank's), so they are not the bits a single
process would hold for the whole matrix: the method's values, at another granularity. Newton-
Schulz (Muon, ROOT) needs whole matrices and is not element-wise: not for this adapter.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..formats.random import stream_seed


def local_shard(p: Tensor) -> Tensor:
    """A plain tensor aliasing p's local shard (p's own storage; p itself if not a DTensor).
    A local shard that wraps one plain tensor (a tensor subclass with FSDP2's all-gather hooks,
    as train/fsdp_nvfp4.py makes) gives that tensor, which kernels can read by pointer."""
    with torch.no_grad():
        t = (p.to_local() if hasattr(p, "to_local") else p).detach()
        if type(t) is not Tensor and hasattr(t, "__tensor_flatten__"):
            inner, _ = t.__tensor_flatten__()
            if len(inner) == 1:
                t = getattr(t, inner[0])
        return t


def shard_of(params: list[Tensor]) -> tuple[int, int] | None:
    """(rank, world size) of the mesh FSDP2 sharded `params` over (DTensors, one 1-D mesh);
    None when none of them is sharded."""
    meshes = {p.device_mesh for p in params if hasattr(p, "device_mesh")}
    if not meshes:
        return None
    if len(meshes) > 1 or next(iter(meshes)).ndim != 1:
        raise ValueError("the optimizer's parameters are sharded over several device meshes, or "
                         "a mesh of more than one dimension (HSDP); one 1-D FSDP2 mesh is "
                         "supported")
    mesh = meshes.pop()
    return mesh.get_local_rank(), mesh.size()


class ShardLocal:
    """The optimizer `make(groups)` over the local shards of `groups`' parameters.

    Built at the first step (after FSDP2's lazy initialisation has placed the shards); until
    then `param_groups` are the given groups, whose options (lr, ...) the inner optimizer
    takes. Each group's `seed`, where it has one, becomes a seed of (seed, rank), so the
    ranks' stochastic rounding draws differ. `state_dict()` holds this rank's states; a
    checkpoint gathers every rank's (see train/checkpoint.py).
    """

    shard_local = True

    def __init__(self, groups: list[dict[str, Any]], make: Callable[[list[dict]],
                 torch.optim.Optimizer], rank: int, world_size: int) -> None:
        self.param_groups = groups
        self.make, self.rank, self.world_size = make, rank, world_size
        self.inner: torch.optim.Optimizer | None = None
        self._params: list[Tensor] = [p for g in groups for p in g["params"]]
        self._locals: list[Tensor] = []
        self._pending: dict[str, Any] | None = None

    def add_param_group(self, group: dict[str, Any]) -> None:
        """Add a group (before the first step, when the inner optimizer is built)."""
        if self.inner is not None:
            raise RuntimeError("ShardLocal: groups are added before the first step")
        self.param_groups.append(group)
        self._params.extend(group["params"])

    def _build(self) -> None:
        self._locals = [local_shard(p) for p in self._params]
        alias = dict(zip(map(id, self._params), self._locals, strict=True))
        groups = []
        for g in self.param_groups:
            group = {**g, "params": [alias[id(p)] for p in g["params"]]}
            if "seed" in g:
                group["seed"] = stream_seed(g["seed"], self.rank) >> 2
            groups.append(group)
        self.inner = self.make(groups)
        if self._pending is not None:
            self.inner.load_state_dict(self._pending)
            self._pending = None
            # The loaded groups carry the saved learning rates; this step's were set since.
            for loaded, current in zip(self.inner.param_groups, self.param_groups, strict=True):
                loaded["lr"] = current["lr"]
        self.param_groups = self.inner.param_groups

    def _check_aliases(self) -> None:
        for p, local in zip(self._params, self._locals, strict=True):
            now = local_shard(p)
            if now.data_ptr() != local.data_ptr() or now.shape != local.shape:
                raise RuntimeError(
                    "ShardLocal: FSDP2 moved a parameter's shard since the optimizer's first "
                    f"step (shape {tuple(local.shape)} -> {tuple(now.shape)}); build the "
                    "optimizer after the model is sharded and keep its sharding fixed")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of the inner optimizer on this rank's rows (params without a gradient are
        skipped, as the inner optimizer skips them)."""
        if self.inner is None:
            self._build()
        else:
            self._check_aliases()
        for p, local in zip(self._params, self._locals, strict=True):
            local.grad = None if p.grad is None else local_shard(p.grad)
        try:
            return self.inner.step(closure)
        finally:
            for local in self._locals:
                local.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """This rank's inner state_dict, with the rank and world size it belongs to."""
        inner = self.inner.state_dict() if self.inner is not None else self._pending
        return {"rank": self.rank, "world_size": self.world_size, "inner": inner}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this rank's state_dict (a ValueError when it is another rank's or world's)."""
        if (state_dict.get("rank"), state_dict.get("world_size")) != (self.rank,
                                                                        self.world_size):
            raise ValueError(
                f"this optimizer state is rank {state_dict.get('rank')} of "
                f"{state_dict.get('world_size')}, not rank {self.rank} of {self.world_size}: "
                f"sharded optimizer states resume on as many ranks as they were saved from")
        if state_dict["inner"] is None:  # saved before any step: nothing to restore
            return
        if self.inner is None:  # applied at the first step; a copy, as torch's loader takes
            self._pending = copy.deepcopy(state_dict["inner"])
        else:
            self.inner.load_state_dict(state_dict["inner"])

    def state_bytes(self) -> int:
        """Bytes of this rank's states (the inner optimizer's count, where it keeps one)."""
        count = getattr(self.inner, "state_bytes", None)
        return count() if count is not None else 0
