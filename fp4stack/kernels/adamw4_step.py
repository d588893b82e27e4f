"""Launching the fused AdamW4 step (kernels/adamw4.py): the per-step scalars, the device tables
of a set of tensors (kernels/adamw4_layout.py), the launch sequence of a step and its CUDA graph.

`fused_step` is what AdamW4 calls; a `StepPlan` per set of tensors keeps the tables, scratch
buffers and graphs alive between steps (AdamW4 owns the cache). The tilings are read from
kernels/adamw4.py (`kern`) at each plan's creation, so a sweep can change them.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct

import torch
from torch import Tensor

from ..formats.random import lowbias32_int
from ..formats.tensor import BLOCK
from . import adamw4 as kern
from . import adamw4_layout as layout
from . import cdiv
from .nvfp4 import _launch_options

# Pinned host buffers of the per-step scalars, used in turn (StepPlan.set_scalars).
SCALAR_SLOTS = 64


def step_scalars(step: int, *, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, headroom: float, seed: int) -> bytes:
    """The per-step scalars buffer's bytes: float32 values rounded once from Python's float64
    (as the reference's scalar operands are), then the seed hash and the step as int32."""
    seed_hash = lowbias32_int(seed ^ (seed >> 32))
    return struct.pack(
        "<8f2i", 1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2,
        1.0 / (1 - beta2**step) ** 0.5, eps, -(lr / (1 - beta1**step)), headroom,
        seed_hash - (1 << 32) if seed_hash >= 1 << 31 else seed_hash, step)


class StepPlan:
    """Device tables and buffers of one set of tensors (kept alive here, so the pointers stay
    valid), and the CUDA graphs of its step (`run`)."""

    def __init__(self, params: list[Tensor], states: list[dict], indices: list[int]) -> None:
        device = params[0].device
        self.tilings = _tilings()
        self.step_tiling, self.sums_tiling = self.tilings
        # (rows, blocks) of a program's tiles: of the step passes, of the sums pass.
        tiles = [(self.step_tiling[0] * self.step_tiling[2], self.step_tiling[1]),
                 (self.sums_tiling[0] * self.sums_tiling[2], self.sums_tiling[1])]
        counts: list[list[int]] = [[], [], []]  # step tiles, sums tiles, lines per tensor
        starts = [0, 0, 0]
        table = []
        scratch = 0
        even = [True, True]  # every tile full: of the step tiles, of the sums tiles
        for i, (p, state, index) in enumerate(zip(params, states, indices, strict=True)):
            k = p.shape[-1]
            r = p.numel() // k
            tensors = [p, *(state[f] for f in layout.FIELDS)]
            ptrs = [t.data_ptr() for t in tensors]
            if (any(ptr % 16 for ptr in ptrs) or p.numel() >= 2**31
                    or not all(t.is_contiguous() for t in tensors)):
                raise ValueError("the fused AdamW4 step needs contiguous 16-byte aligned tensors "
                                 "of fewer than 2**31 elements")
            col_tiles = [cdiv(k // BLOCK, kb) for _, kb in tiles]
            n = [cdiv(r, bm) * c for (bm, _), c in zip(tiles, col_tiles, strict=True)]
            n.append(cdiv(r + k, kern.LINE))
            for e, (bm, kb) in enumerate(tiles):
                even[e] &= r % bm == 0 and (k // BLOCK) % kb == 0
            table.append([*ptrs, r, k, scratch, index, starts[2],
                          starts[0], col_tiles[0], starts[1], col_tiles[1], 2 * i])
            for j in range(3):
                counts[j].append(n[j])
                starts[j] += n[j]
            scratch += r + k + 1  # per row and column (the sums: and the total)
        self.meta = torch.tensor(table, dtype=torch.int64, device=device)
        self.work, self.sums_work, self.line_work = (_work_list(c, device) for c in counts)
        self.device = device
        self.even, self.even_sums = even
        # float64 sums of v, the roots of its factors and their reciprocals (float32).
        self.sums = torch.zeros(scratch, dtype=torch.float64, device=device)
        self.roots = torch.zeros(scratch, dtype=torch.float32, device=device)
        self.inv = torch.zeros(scratch, dtype=torch.float32, device=device)
        self.pending = torch.zeros(2 * len(params), dtype=torch.float32, device=device)
        self.scalars = torch.zeros(layout.NSCALARS, dtype=torch.float32, device=device)
        if device.type == "cuda":
            self.scalar_host = torch.zeros(SCALAR_SLOTS, layout.NSCALARS,
                                           dtype=torch.float32).pin_memory()
            self.scalar_done = [torch.cuda.Event() for _ in range(SCALAR_SLOTS)]
        self.next_slot = 0
        self.keep = [params, [dict(s) for s in states]]
        self.grad_key: list[int] = []
        self.grad_ptrs: Tensor | None = None
        self.graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        self.warm: set[bool] = set()

    def set_grads(self, grads: list[Tensor]) -> None:
        # Gradients are often at the same addresses step after step (the caching allocator
        # hands the same blocks back): upload their pointers only when they moved.
        ptrs = [g.data_ptr() for g in grads]
        if self.grad_ptrs is None or ptrs != self.grad_key:
            self.grad_key = ptrs
            host = torch.tensor(ptrs, dtype=torch.int64)
            if self.grad_ptrs is None:
                self.grad_ptrs = host.to(self.device)
            else:  # in place: a captured graph reads the table at this address
                self._upload(self.grad_ptrs, host)

    def set_scalars(self, packed: bytes) -> None:
        if self.device.type != "cuda":
            self.scalars.copy_(torch.frombuffer(bytearray(packed), dtype=torch.float32))
            return
        # From a ring of pinned buffers allocated once (a fresh pinned tensor per step costs
        # more than the rest of the upload). A slot is rewritten only after the copy that read
        # it last has run (its event): the host waits only when it runs SCALAR_SLOTS steps
        # ahead of the GPU.
        i = self.next_slot
        self.next_slot = (i + 1) % SCALAR_SLOTS
        host, done = self.scalar_host[i], self.scalar_done[i]
        done.synchronize()
        ctypes.memmove(host.data_ptr(), packed, len(packed))
        self.scalars.copy_(host, non_blocking=True)
        done.record()

    def _upload(self, dst: Tensor, host: Tensor) -> None:
        if self.device.type == "cuda":
            # From pinned memory (torch's host allocator does not hand the block out again
            # before the copy has run): the host does not wait for the GPU.
            dst.copy_(host.pin_memory(), non_blocking=True)
        else:
            dst.copy_(host)

    def _launch_sums(self) -> None:
        bm, kb, iters, warps, maxnreg = self.sums_tiling
        kern.adamw4_sums_kernel[(self.sums_work.numel(),)](
            self.sums_work, self.meta, self.grad_ptrs, self.scalars, self.sums,
            EVEN=self.even_sums, BM=bm, KB=kb, ITERS=iters, num_warps=warps,
            **_launch_options(maxnreg))

    def _launch(self, pass_: int, decay: bool = False) -> None:
        bm, kb, iters, warps, maxnreg = self.step_tiling
        kern.adamw4_kernel[(self.work.numel(),)](
            self.work, self.meta, self.grad_ptrs, self.scalars, self.scalars.view(torch.int32),
            self.roots, self.inv, self.pending, PASS=pass_, DECAY=decay, EVEN=self.even, BM=bm,
            KB=kb, ITERS=iters, num_warps=warps, **_launch_options(maxnreg))

    def _launch_factors(self, mode: int) -> None:
        kern.adamw4_factors_kernel[(self.line_work.numel(),)](
            self.line_work, self.meta, self.scalars, self.sums, self.roots, self.inv,
            self.pending, MODE=mode, LINE=kern.LINE, **_launch_options())

    def _launch_step(self, decay: bool, first: bool = False) -> None:
        """The launches of one step: the sums of v (zeroed first), its factors, [the first
        step's amaxes], the step pass, the roll of factors and amaxes into the state."""
        self.sums.zero_()
        self._launch_sums()
        self._launch_factors(layout.FACTORS_FIRST.value if first else layout.FACTORS.value)
        if first:
            self._launch(layout.CALIBRATE.value)
        self._launch(layout.STEP.value, decay)
        self._launch_factors(layout.ROLL.value)

    def run(self, decay: bool, graphs: bool, first: bool = False) -> None:
        """One step. A first step calibrates the amaxes on its own v and m (kernels/adamw4.py)
        and is launched directly. After it, with `graphs` (CUDA), the second run with the same
        `decay` captures its launches as a CUDA graph (the first compiled the kernels) and every
        later one replays it."""
        if first:
            self._launch_step(decay, first=True)
            return
        graph = self.graphs.get(decay)
        if graph is not None:
            graph.replay()
            return
        if graphs and decay in self.warm:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._launch_step(decay)
            self.graphs[decay] = graph
            graph.replay()
            return
        self._launch_step(decay)
        self.warm.add(decay)


def _tilings() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(rows, blocks, iterations, warps, register cap) of a program of the step passes and
    of the sums pass, as now set."""
    return ((kern.BM, kern.KB, kern.STEP_ITERS, kern.NUM_WARPS, kern.STEP_MAXNREG),
            (kern.SUMS_BM, kern.SUMS_KB, kern.SUMS_ITERS, kern.SUMS_WARPS, kern.SUMS_MAXNREG))


def _work_list(counts: list[int], device: torch.device) -> Tensor:
    """Tensor index of each program, for `counts[i]` programs of tensor i."""
    return torch.repeat_interleave(
        torch.arange(len(counts), dtype=torch.int32), torch.tensor(counts)).to(device)


def plan_key(params: list[Tensor], states: list[dict], indices: list[int]) -> tuple:
    """Identifies a plan: the parameters (their indices and storage) and their state tensors
    (the codes of m and v; the reference step replaces all fields of a moment at once, the
    fused one none). The plan keeps them alive, so their ids are not reused meanwhile."""
    return tuple(indices), tuple(p.data_ptr() for p in params), \
        tuple(id(s["exp_avg_data"]) for s in states), \
        tuple(id(s["exp_avg_sq_data"]) for s in states)


def fused_step(
    params: list[Tensor], grads: list[Tensor], states: list[dict], indices: list[int],
    step: int, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
    headroom: float, seed: int, cache: dict, graphs: bool = True,
) -> None:
    """One AdamW4 step of float32 `params` whose states (rank1, NVFP4, delayed scaling) have
    all been stepped `step` times including this one; bit-exact with the reference step. Every
    state field is rewritten in place.

    `cache` (owned by the caller) keeps the plans (device tables, buffers, CUDA graphs) between
    steps. `graphs`: replay CUDA graphs of the step's launches where possible (see
    StepPlan.run).
    """
    if _capturing(params[0]):
        raise RuntimeError("AdamW4's fused step cannot run inside a CUDA graph capture (it "
                           "captures and replays its own launches): call step() outside it")
    key = plan_key(params, states, indices)
    plan = cache.get(key)
    if plan is not None and plan.tilings != _tilings():  # the tiles were changed (a sweep)
        plan = None
    if plan is None:
        if len(cache) >= 8:  # stale plans (another grad pattern, a reload): drop them all
            cache.clear()
        plan = cache[key] = StepPlan(params, states, indices)
    decay = weight_decay != 0
    cuda = plan.device.type == "cuda"
    # Copies, launches and captures go to the current device's stream: make it the tensors'.
    with torch.cuda.device(plan.device) if cuda else contextlib.nullcontext():
        plan.set_grads(grads)
        plan.set_scalars(step_scalars(step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                      weight_decay=weight_decay, headroom=headroom, seed=seed))
        # A first step has no previous amaxes: it takes its own (kernels/adamw4.py).
        plan.run(decay, graphs and cuda, first=step == 1)


def _capturing(p: Tensor) -> bool:
    return p.is_cuda and torch.cuda.is_current_stream_capturing()
