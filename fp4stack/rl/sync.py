"""Weight sync from trainer to rollout engine, with a self-check on every refit.

The trainer's own quantize path produces the packed NVFP4 weights the engine loads (no BF16
export re-quantized on the other side). With each tensor goes a checksum of the values the trainer
multiplies by; the engine recomputes it from what it loaded (its dequantized packed weights) and
stops on the first difference. That catches a wrong expert layout, a transposed tensor, a stale
amax or a flipped bit, which the usual probability-difference metric can miss.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..api import dequantize, quantize
from ..nn.fused import shared_amax
from ..nn.linear import QuantLinear
from ..nn.packed import PackedSlot, PackedState

_MIX = 0x9E3779B1  # odd multiplier: spreads positions over the 32-bit range


class WeightSyncError(RuntimeError):
    """The engine's weights differ from the trainer's after a refit."""


_CACHED_WEIGHTS = 1 << 24  # position weights of tensors up to this size are kept (128 MiB)


def _position_weights(numel: int, device: torch.device) -> Tensor:
    idx = torch.arange(numel, device=device, dtype=torch.int64)
    return (idx * _MIX) % (1 << 32) | 1


@functools.lru_cache(maxsize=8)
def _cached_position_weights(numel: int, device: torch.device) -> Tensor:
    # A refit checks hundreds of tensors of a few shapes: their weights are made once, which
    # takes four of a checksum's seven launches out of every refit after the first.
    return _position_weights(numel, device)


def _checksum(t: Tensor) -> Tensor:
    # A 0-d int64 tensor on t's device: no host sync per tensor (a refit checks hundreds).
    bits = t.detach().float().contiguous().view(-1).view(torch.int32).long()
    weights = (_cached_position_weights if bits.numel() <= _CACHED_WEIGHTS
               else _position_weights)(bits.numel(), bits.device)
    return (bits * weights).sum()


def checksum(t: Tensor) -> int:
    """A position-sensitive hash of t's values as float32 bit patterns (equal iff bit-identical,
    up to hash collisions): sum_i bits_i * (i * MIX mod 2^32 | 1), wrapping in int64."""
    return int(_checksum(t).item())


def _to_ints(sums: dict[str, Tensor]) -> dict[str, int]:
    # One transfer for all checksums of a refit.
    if not sums:
        return {}
    return dict(zip(sums, torch.stack(list(sums.values())).tolist(), strict=True))


@dataclass
class WeightUpdate:
    """What the trainer sends: per engine tensor name the tensor to load, and per checked name
    (a weight, or "<experts>.<proj>[e]") the checksum of the trainer's values."""

    tensors: dict[str, Tensor] = field(default_factory=dict)
    checksums: dict[str, int] = field(default_factory=dict)


def _trainer_weight(trainer: nn.Module, name: str) -> Tensor:
    for get in (trainer.get_parameter, trainer.get_buffer):
        try:
            return get(name).detach()
        except AttributeError:
            continue
    raise WeightSyncError(f"the trainer has no tensor {name!r} that the engine needs; are "
                          "trainer and engine built from the same model?")


def _group_amax(trainer: nn.Module, prefix: str, groups: dict[str, list[str]]) -> Tensor | None:
    members = groups.get(prefix)
    if members is None:
        return None
    return shared_amax(_trainer_weight(trainer, m + ".weight") for m in members)


def _pack_slot(trainer: nn.Module, p: str, slot: PackedSlot,
               amax: Tensor | None) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    # The engine buffers of `slot` holding the trainer's master weight quantized, and per entry
    # the checksum of the values the trainer multiplies by.
    w = _trainer_weight(trainer, p + slot.master)
    parts = [w] if slot.count is None else list(w)
    packed = [quantize(x, spec=slot.spec, amax=amax) for x in parts]
    state = slot.state(packed)
    # dequantize(quantize(x)) is fake_quantize(x) bit for bit: one quantization per entry
    sums = {p + entry: _checksum(dequantize(q, torch.float32))
            for entry, q in zip(slot.entries(), packed, strict=True)}
    return {p + k: v for k, v in state.items()}, sums


@torch.no_grad()
def export_weights(trainer: nn.Module, engine: nn.Module,
                   amax_groups: list[list[str]] = ()) -> WeightUpdate:
    """The update that makes `engine` (a converted copy of the policy) hold `trainer`'s weights.

    Packed engine tensors (`PackedState`) get NVFP4 data, scales and amax quantized here from the
    trainer's master weight (fused groups in `amax_groups` share one amax); every other engine
    tensor is copied.
    """
    groups = {name: members for members in amax_groups for name in members}
    update = WeightUpdate()
    sums: dict[str, Tensor] = {}
    packed = set()
    for prefix, module in engine.named_modules():
        slots = module.packed_slots() if isinstance(module, PackedState) else {}
        if not slots:
            continue
        p = f"{prefix}." if prefix else ""
        amax = _group_amax(trainer, prefix, groups)
        for slot in slots.values():
            state, slot_sums = _pack_slot(trainer, p, slot, amax)
            if isinstance(module, QuantLinear) and module.weight_amax is not None:
                # The amax a packed layer imposes is its packed weight's.
                state[p + "weight_amax"] = state[p + slot.keys[2]]
            update.tensors.update(state)
            sums.update(slot_sums)
            packed.update(state)
    # Calibrated by the engine itself: activation amaxes, compensation channels (an expert
    # stack's rc_channels_<proj> too).
    engine_only = ("x_amax", "rc_channels")
    for name, current in engine.state_dict().items():
        if name in packed or name.rpartition(".")[2].startswith(engine_only):
            continue
        t = _trainer_weight(trainer, name).to(current.dtype)  # e.g. a BF16 engine
        update.tensors[name] = t
        sums[name] = _checksum(t)
    update.checksums = _to_ints(sums)
    return update


@torch.no_grad()
def load_weights(engine: nn.Module, update: WeightUpdate) -> int:
    """Load `update` into `engine` and verify every checksum against the engine's own view of
    the weights (dequantized packed NVFP4, or the tensor as stored). Returns tensors checked;
    raises WeightSyncError naming the first tensor that differs."""
    state = engine.state_dict()
    for name, t in update.tensors.items():
        if name not in state:
            raise WeightSyncError(f"the update has {name!r}, which the engine does not hold")
        if state[name].shape != t.shape:
            raise WeightSyncError(f"{name}: the update's shape {tuple(t.shape)} != the engine's "
                                  f"{tuple(state[name].shape)}")
        state[name].copy_(t)
    sums: dict[str, Tensor] = {}
    for prefix, module in engine.named_modules():
        if isinstance(module, PackedState):
            p = f"{prefix}." if prefix else ""
            for entry, t in module.packed_tensors():
                sums[p + entry] = _checksum(dequantize(t, torch.float32))
    for name, t in engine.state_dict().items():
        if name in update.checksums:
            sums[name] = _checksum(t)
    for name, got in _to_ints(sums).items():
        want = update.checksums.get(name)
        if want is None:
            raise WeightSyncError(f"the update carries no checksum for {name!r}")
        if got != want:
            raise WeightSyncError(
                f"weight sync self-check failed for {name!r}: the engine's weights are not the "
                f"trainer's (checksum {got:#x} != {want:#x}). The rollout would sample from a "
                "different model than the one being trained; refusing to continue.")
    return len(sums)
