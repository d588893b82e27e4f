"""The rollout engine in a process of its own: trainer and engine as ranks 0 and 1 of a
torch.distributed group (NCCL between two GPUs, gloo on CPU), `engine_device: process`.

One process per GPU is how RL frameworks lay out trainer and inference server. Beside the
threaded engine of one process (`engine_device: cuda:1`), it takes the engine's Python off the
trainer's interpreter lock: a step's thousands of kernel launches on either side no longer wait
for the other's.

Everything goes through one message: a small picklable header, then named tensors packed into a
few flat byte buffers (at most BUCKET_BYTES each, every tensor 16-byte aligned in its buffer) and
sent point to point. A refit is the header ("sync", per-tensor checksums) with the trainer's
packed NVFP4 data, scales and amax (`export_update`, with the plan the engine sent once at the
start); the engine loads it and checks every checksum against what it holds, as in one
process (fp4stack.rl.sync). A generation is a header with the prompts, answered by the rollout's
tensors. The engine samples from its own generator, seeded as one process seeds its engine's,
so a two-process run draws the same tokens as a one-process run on the same devices.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import policy as lm
from .rollout import Rollout, RolloutEngine
from .sync import WeightSyncError, WeightUpdate, export_update

TRAINER_RANK, ENGINE_RANK = 0, 1
BUCKET_BYTES = 256 << 20  # the largest buffer of one send: bounds the refit's extra memory
_ALIGN = 16
_ROUTING = "routing."


def _layout(tensors: dict[str, Tensor]) -> list[tuple[list[tuple], int]]:
    # Buckets of (name, dtype, shape, byte offset) and each bucket's size in bytes.
    buckets, entries, size = [], [], 0
    for name, t in tensors.items():
        padded = -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        if entries and size + padded > BUCKET_BYTES:
            buckets.append((entries, size))
            entries, size = [], 0
        entries.append((name, t.dtype, tuple(t.shape), size))
        size += padded
    if entries:
        buckets.append((entries, size))
    return buckets


def send(header: Any, dst: int, tensors: dict[str, Tensor] | None = None,
         device: torch.device | None = None) -> None:
    """Send `header` (any picklable object) and `tensors` to rank `dst`. The buffers are made on
    `device` (the tensors' own by default): NCCL sends from this process's GPU."""
    tensors = tensors or {}
    layout = _layout(tensors)
    dist.send_object_list([(header, layout)], dst=dst)
    for entries, size in layout:
        # One concatenation a bucket, not a copy a tensor (a refit sends thousands): each
        # tensor's bytes, then the zeros that pad it to the next one's aligned offset.
        target = device or tensors[entries[0][0]].device
        zeros = torch.zeros(_ALIGN, dtype=torch.uint8, device=target)
        ends = [e[3] for e in entries[1:]] + [size]
        parts = []
        for (name, _, _, offset), end in zip(entries, ends, strict=True):
            t = tensors[name].detach().to(target).contiguous().reshape(-1).view(torch.uint8)
            parts += [t, zeros[:end - offset - t.numel()]]
        dist.send(torch.cat(parts), dst=dst)


def recv(src: int, device: torch.device) -> tuple[Any, dict[str, Tensor]]:
    """(header, tensors) of the next `send` from rank `src`, the tensors on `device` (views of
    the received buffers)."""
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src)
    header, layout = box[0]
    tensors = {}
    for entries, size in layout:
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        dist.recv(buf, src=src)
        for name, dtype, shape, offset in entries:
            nbytes = math.prod(shape) * dtype.itemsize
            tensors[name] = buf[offset:offset + nbytes].view(dtype).view(shape)
    return header, tensors


def _rollout_tensors(rollout: Rollout) -> dict[str, Tensor]:
    out = {"tokens": rollout.tokens, "mask": rollout.mask,
           "response_mask": rollout.response_mask, "logprobs": rollout.logprobs}
    out.update({_ROUTING + k: v for k, v in (rollout.routing or {}).items()})
    return out


def serve(engine: RolloutEngine, generator: torch.Generator | None, kind: str,
          peer: int = TRAINER_RANK) -> int:
    """Run `engine` for the trainer at rank `peer` until it says stop: refits, generations and
    calibrations, in the order they come. An error in one is sent back for the trainer to
    raise, and the engine waits for the next request. Returns the requests served."""
    device = engine.device
    send(("ready", engine.refit_plan(), engine.recipe, engine.precision, kind, str(device)),
         peer, device=device)
    served = 0
    while True:
        request, tensors = recv(peer, device)
        op = request[0]
        if op == "stop":
            return served
        reply, out = None, None
        try:
            if op == "sync":
                reply = engine.load(WeightUpdate(tensors, request[1]))
            elif op == "generate":
                prompts, temperature, sample, record = request[1:]
                engine.temperature = temperature
                rollout = engine.generate(prompts, generator if sample else None, record=record)
                reply, out = rollout.prompt_len, _rollout_tensors(rollout)
            elif op == "calibrate":
                reply = engine.calibrate(request[1])
            else:
                raise ValueError(f"unknown request {op!r}")
        except Exception as e:  # the trainer raises it; the engine stays up for its stop
            send(("error", type(e).__name__, str(e)), peer, device=device)
        else:
            send(("ok", reply), peer, out, device=device)
        served += 1


class RemoteEngine:
    """The trainer's handle on an engine that `serve`s in another process: the same calls as
    `RolloutEngine` (sync, generate, calibrate), each a message to it and its reply.

    Construct it once the engine process is up: it waits for the engine's first message (its
    refit plan, recipe and device). `generate`'s generator only says whether to sample (any
    generator) or decode greedily (None): the engine process draws from its own.
    """

    def __init__(self, tokenizer: lm.TokenizerLike, device: torch.device, *,
                 temperature: float = 1.0, peer: int = ENGINE_RANK) -> None:
        self.tokenizer, self.temperature, self.peer = tokenizer, temperature, peer
        self.local_device = device
        header, _ = recv(peer, device)
        if header[0] != "ready":
            raise RuntimeError(f"the rollout engine process (rank {peer}) did not start: "
                               f"{header}")
        _, self.plan, self.recipe, self.precision, self.kind, self.remote_device = header
        self.syncs = 0
        self._open = True

    @property
    def device(self) -> str:
        return f"{self.remote_device} (rank {self.peer})"

    def _call(self, header: tuple, tensors: dict[str, Tensor] | None = None
              ) -> tuple[Any, dict[str, Tensor]]:
        send(header, self.peer, tensors, device=self.local_device)
        reply, out = recv(self.peer, self.local_device)
        if reply[0] == "error":
            error = WeightSyncError if reply[1] == WeightSyncError.__name__ else RuntimeError
            raise error(f"rollout engine (rank {self.peer}): {reply[1]}: {reply[2]}")
        return reply[1], out

    def sync(self, trainer: nn.Module) -> int:
        """Send `trainer`'s weights (packed as the engine's plan says); the engine checks
        every tensor. Returns the number it verified."""
        update = export_update(trainer, self.plan)
        checked, _ = self._call(("sync", update.checksums), update.tensors)
        self.syncs += 1
        return checked

    def generate(self, prompts: list[list[int]], generator: torch.Generator | None = None,
                 record: bool = False) -> Rollout:
        """The engine's rollout of `prompts` (see RolloutEngine.generate), on this process's
        device."""
        prompt_len, t = self._call(("generate", prompts, self.temperature,
                                    generator is not None, record))
        routing = {k[len(_ROUTING):]: v for k, v in t.items() if k.startswith(_ROUTING)}
        return Rollout(t["tokens"], t["mask"], t["response_mask"], t["logprobs"], prompt_len,
                       routing or None)

    def calibrate(self, sequences: list[list[int]]) -> int:
        """The engine's `calibrate` (static compensation channels)."""
        return self._call(("calibrate", sequences))[0]

    def close(self) -> None:
        """Tell the engine process to stop (once)."""
        if self._open:
            self._open = False
            send(("stop",), self.peer, device=self.local_device)
