"""Weight sync from trainer to rollout engine, with a self-check on every refit.

The trainer's own quantize path produces the packed NVFP4 weights the engine loads (no BF16
export re-quantized on the other side). With each tensor goes a checksum of the values the trainer
multiplies by; the engine recomputes it from what it loaded (its dequantized packed weights) and
stops on the first difference. That catches a wrong expert layout, a transposed tensor, a stale
amax or a flipped bit, which the usual probability-difference metric can miss.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from ..api import dequantize, quantize, quantize_stack, stackable
from ..formats.tensor import NVFP4Tensor
from ..nn.fused import shared_amax
from ..nn.linear import QuantLinear
from ..nn.packed import PackedSlot, PackedState

_MIX = 0x9E3779B1  # odd multiplier: spreads positions over the 32-bit range


class WeightSyncError(RuntimeError):
    """The engine's weights differ from the trainer's after a refit."""


_CACHED_WEIGHTS = 1 << 24  # position weights of tensors up to this size are kept (128 MiB)


def _position_weights(numel: int, device: torch.device, offset: int = 0) -> Tensor:
    idx = torch.arange(offset, offset + numel, device=device, dtype=torch.int64)
    return (idx * _MIX) % (1 << 32) | 1


@functools.lru_cache(maxsize=8)
def _cached_position_weights(numel: int, device: torch.device) -> Tensor:
    # A refit checks hundreds of tensors of a few shapes: their weights are made once, which
    # takes four of a checksum's seven launches out of every refit after the first.
    return _position_weights(numel, device)


def _weights(numel: int, device: torch.device, offset: int = 0) -> Tensor:
    # The position weights of elements offset .. offset + numel - 1 (whole tensors' cached).
    if offset == 0 and numel <= _CACHED_WEIGHTS:
        return _cached_position_weights(numel, device)
    return _position_weights(numel, device, offset)


def _checksum(t: Tensor, offset: int = 0) -> Tensor:
    # A 0-d int64 tensor on t's device: no host sync per tensor (a refit checks hundreds).
    bits = t.detach().float().contiguous().view(-1).view(torch.int32).long()
    return (bits * _weights(bits.numel(), bits.device, offset)).sum()


def _stack_checksums(data: Tensor, scales: Tensor, amax: Tensor, slot: PackedSlot
                     ) -> dict[str, Tensor]:
    # Per entry of a packed stack (buffers [E, ...], amax [E]), the checksum of its dequantized
    # values, all from one dequantization: each row decoded with its matrix's amax (row-scaled),
    # the bits of dequantizing one matrix at a time, and the sums in one reduction.
    e, (m, k) = data.shape[0], slot.shape
    if slot.spec.is_2d or slot.spec.row_scaled or len(slot.shape) != 2:
        return {f"{slot.name}[{i}]": _checksum(dequantize(
                    NVFP4Tensor(data[i], scales[i], amax[i], slot.shape, slot.spec), torch.float32))
                for i in range(e)}
    rows = NVFP4Tensor(data.reshape(e * m, -1), scales.reshape(e * m, -1),
                       amax.reshape(e, 1).expand(e, m).reshape(e * m, 1), (e * m, k),
                       replace(slot.spec, global_scale="row"))
    bits = dequantize(rows, torch.float32).reshape(e, m * k).view(torch.int32).long()
    # integer sums: the order does not change them
    sums = (bits * _weights(m * k, bits.device)).sum(dim=1)
    return dict(zip(slot.entries(), sums.unbind(0), strict=True))


def checksum(t: Tensor, offset: int = 0) -> int:
    """A position-sensitive hash of t's values as float32 bit patterns (equal iff bit-identical,
    up to hash collisions): sum_i bits_i * ((offset + i) * MIX mod 2^32 | 1), wrapping in int64.

    With `offset`, t is the part of a larger tensor that starts at that (flat) element: the
    checksums of a tensor's contiguous shards, each with its own offset, add up (wrapping in
    int64) to the whole tensor's, so shards held by several ranks are checked with one
    all-reduce of their sums."""
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    return int(_checksum(t, offset).item())


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


def _pack_slot(trainer: nn.Module, p: str, slot: PackedSlot,
               amax: Tensor | None) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    # The engine buffers of `slot` holding the trainer's master weight quantized, and per entry
    # the checksum of the values the trainer multiplies by.
    w = _trainer_weight(trainer, p + slot.master)
    if slot.count is None:
        packed = [quantize(w, spec=slot.spec, amax=amax)]
    elif amax is None and stackable(slot.spec):  # every expert at once, each its own amax
        packed = quantize_stack(w, slot.spec)
    else:
        packed = [quantize(x, spec=slot.spec, amax=amax) for x in w]
    state = slot.state(packed)
    # dequantize(quantize(x)) is fake_quantize(x) bit for bit: one quantization per entry
    if slot.count is None:
        sums = {p + slot.name: _checksum(dequantize(packed[0], torch.float32))}
    else:
        sums = {p + entry: v for entry, v in
                _stack_checksums(*(state[key] for key in slot.keys), slot).items()}
    return {p + k: v for k, v in state.items()}, sums


@dataclass(frozen=True)
class PackedModule:
    """An engine module holding packed NVFP4 tensors: its name prefix ("layers.0.mlp."), its
    slots, the fused group whose weights share one amax (their names, or None), and whether it
    is a QuantLinear whose `weight_amax` follows its packed weight."""

    prefix: str
    slots: tuple[PackedSlot, ...]
    amax_group: tuple[str, ...] | None
    sets_weight_amax: bool


@dataclass(frozen=True)
class RefitPlan:
    """What a refit sends, read once from the engine: its packed modules, and every other
    tensor (name, dtype) copied from the trainer. Picklable: an engine in another process
    sends its plan to the trainer once (fp4stack.rl.remote)."""

    packed: tuple[PackedModule, ...]
    copied: tuple[tuple[str, torch.dtype], ...]


# Calibrated by the engine itself, never sent: activation amaxes, compensation channels (an
# expert stack's rc_channels_<proj> too).
_ENGINE_ONLY = ("x_amax", "rc_channels")


def refit_plan(engine: nn.Module, amax_groups: list[list[str]] = ()) -> RefitPlan:
    """The plan of `engine`'s refits (fused groups in `amax_groups` share one amax)."""
    groups = {name: tuple(members) for members in amax_groups for name in members}
    packed, names = [], set()
    for prefix, module in engine.named_modules():
        slots = module.packed_slots() if isinstance(module, PackedState) else {}
        if not slots:
            continue
        p = f"{prefix}." if prefix else ""
        sets = isinstance(module, QuantLinear) and module.weight_amax is not None
        packed.append(PackedModule(p, tuple(slots.values()), groups.get(prefix), sets))
        names.update(p + key for slot in slots.values() for key in slot.keys)
        if sets:
            names.add(p + "weight_amax")
    copied = tuple((name, t.dtype) for name, t in engine.state_dict().items()
                   if name not in names and not name.rpartition(".")[2].startswith(_ENGINE_ONLY))
    return RefitPlan(tuple(packed), copied)


@torch.no_grad()
def export_update(trainer: nn.Module, plan: RefitPlan) -> WeightUpdate:
    """The update, made from `trainer`'s weights, that `plan`'s engine loads: packed tensors
    quantized here from the trainer's master weights, every other tensor copied."""
    update = WeightUpdate()
    sums: dict[str, Tensor] = {}
    for module in plan.packed:
        amax = (None if module.amax_group is None else
                shared_amax(_trainer_weight(trainer, m + ".weight") for m in module.amax_group))
        for slot in module.slots:
            state, slot_sums = _pack_slot(trainer, module.prefix, slot, amax)
            if module.sets_weight_amax:  # the amax a packed layer imposes is its packed weight's
                state[module.prefix + "weight_amax"] = state[module.prefix + slot.keys[2]]
            update.tensors.update(state)
            sums.update(slot_sums)
    for name, dtype in plan.copied:
        t = _trainer_weight(trainer, name).to(dtype)  # e.g. a BF16 engine
        update.tensors[name] = t
        sums[name] = _checksum(t)
    update.checksums = _to_ints(sums)
    return update


def export_weights(trainer: nn.Module, engine: nn.Module,
                   amax_groups: list[list[str]] = ()) -> WeightUpdate:
    """The update that makes `engine` (a converted copy of the policy) hold `trainer`'s weights:
    `export_update` with the engine's `refit_plan`."""
    return export_update(trainer, refit_plan(engine, amax_groups))


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
            for slot in module.packed_slots().values():
                if slot.count is None:
                    sums[p + slot.name] = _checksum(dequantize(slot.read(module), torch.float32))
                    continue
                parts = (getattr(module, key) for key in slot.keys)
                sums.update({p + entry: v for entry, v in
                             _stack_checksums(*parts, slot).items()})
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
