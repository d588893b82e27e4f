"""Packed NVFP4 state: NVFP4Tensors that a module holds as buffers, under fixed state-dict keys.

A packed tensor `name` is three buffers: `<name>_data` (uint8 codes), `<name>_scales` (E4M3) and
`<name>_<amax_key>` (the float32 global amax: "global_amax" for a linear layer's weight, "amax"
for stacked experts, the keys checkpoints already use), so a state dict holds its bytes and
nothing else. What is not a tensor (the logical shape, the QuantSpec, the master parameter it
replaces) is kept in a `PackedSlot` on the module. A stack of tensors (one per expert) stores each
buffer stacked along a new leading dim and is read back one entry at a time.

Modules that pack mix in `PackedState`; whoever moves packed weights around (weight sync,
checkpoint export) goes through its methods instead of naming buffers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ..formats.spec import QuantSpec
from ..formats.tensor import NVFP4Tensor

_PARTS = ("data", "scales", "amax")


@dataclass(frozen=True)
class PackedSlot:
    """Where a module keeps one packed NVFP4 tensor, or a stack of `count` of them.

    name:     prefix of the buffers ("weight": weight_data, weight_scales, weight_global_amax).
    master:   the full-precision parameter the packed form stands for ("weight", "down_proj").
    shape:    the logical shape of one tensor; spec: how it was quantized.
    amax_key: suffix of the amax buffer.
    count:    None for a single tensor, else the length of the stack's leading dim.
    """

    name: str
    master: str
    shape: torch.Size
    spec: QuantSpec
    amax_key: str = "global_amax"
    count: int | None = None

    @property
    def keys(self) -> tuple[str, str, str]:
        """The names of the data, scales and amax buffers."""
        return f"{self.name}_data", f"{self.name}_scales", f"{self.name}_{self.amax_key}"

    def entries(self) -> list[str]:
        """The name of each tensor held: the slot's, or `name[i]` for entry i of a stack."""
        if self.count is None:
            return [self.name]
        return [f"{self.name}[{i}]" for i in range(self.count)]

    def state(self, tensors: Sequence[NVFP4Tensor]) -> dict[str, torch.Tensor]:
        """The buffers, by name, that hold `tensors` (one per entry, in order)."""
        if len(tensors) != len(self.entries()):
            raise ValueError(f"packed {self.name!r} holds {len(self.entries())} tensors, got "
                             f"{len(tensors)}")
        for t in tensors:
            if t.shape != self.shape or t.spec != self.spec:
                raise ValueError(f"packed {self.name!r} holds {tuple(self.shape)} tensors of spec "
                                 f"{self.spec}, got {tuple(t.shape)} of spec {t.spec}; quantize "
                                 "with the slot's spec")
        if self.count is None:
            parts = [getattr(tensors[0], p) for p in _PARTS]
        else:
            parts = [torch.stack([getattr(t, p) for t in tensors]) for p in _PARTS]
        return dict(zip(self.keys, parts, strict=True))

    def read(self, module: torch.nn.Module, index: int | None = None) -> NVFP4Tensor:
        """The tensor held by `module` (entry `index` of a stack)."""
        if self.count is None and index is not None:
            raise ValueError(f"packed {self.name!r} is a single tensor: pass no index")
        if self.count is not None and index is None:
            raise ValueError(f"packed {self.name!r} is a stack of {self.count}: pass an index")
        data, scales, amax = (getattr(module, k) for k in self.keys)
        if index is not None:
            data, scales, amax = data[index], scales[index], amax[index]
        return NVFP4Tensor(data, scales, amax, self.shape, self.spec)


class PackedState:
    """Mixin for modules holding packed NVFP4 tensors (see the module docstring)."""

    def packed_slots(self) -> dict[str, PackedSlot]:
        """The packed tensors' slots, by name (empty while nothing is packed)."""
        return vars(self).get("_packed_slots", {})

    def register_packed(self, slot: PackedSlot, tensors: Sequence[NVFP4Tensor]) -> None:
        """Hold `tensors` as the buffers of `slot` (the state dict gains exactly its keys)."""
        for key, value in slot.state(tensors).items():
            self.register_buffer(key, value)
        vars(self)["_packed_slots"] = {**self.packed_slots(), slot.name: slot}

    def read_packed(self, name: str, index: int | None = None) -> NVFP4Tensor:
        """The packed tensor `name` (entry `index` of a stack)."""
        slots = self.packed_slots()
        if name not in slots:
            raise KeyError(f"{type(self).__name__} holds no packed tensor {name!r}; it has "
                           f"{sorted(slots)} (pack() first)")
        return slots[name].read(self, index)

    @torch.no_grad()
    def write_packed(self, name: str, tensors: Sequence[NVFP4Tensor]) -> None:
        """Copy `tensors` into the buffers of the packed tensor `name`, in place."""
        for key, value in self.packed_slots()[name].state(tensors).items():
            buf = getattr(self, key)
            buf.copy_(value.to(buf.device))

    def packed_tensors(self) -> Iterator[tuple[str, NVFP4Tensor]]:
        """Every packed tensor as (entry name, NVFP4Tensor): "weight", or "gate_up[3]" for
        entry 3 of a stack."""
        for slot in self.packed_slots().values():
            indices = [None] if slot.count is None else range(slot.count)
            for entry, i in zip(slot.entries(), indices, strict=True):
                yield entry, slot.read(self, i)

    def packed_column_norms(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """float32 ||Q(W)[:, c]||² of the packed tensor `name` read in `dtype`: [K], or [E, K]
        for a stack (residual compensation's channel energy). Computed from the packed bytes by
        one kernel and kept while the buffers are unchanged (their version counters); when they
        change, recomputed into the same tensor, so a CUDA graph that captured it reads the new
        norms once `refresh_column_norms` ran (rollout engines refresh after every sync)."""
        from ..kernels.packed_gemm import PackedExperts, column_sq_norms

        slot = self.packed_slots()[name]
        parts = tuple(getattr(self, key) for key in slot.keys)
        w = (slot.read(self) if slot.count is None
             else PackedExperts(*parts, slot.shape[-1], slot.spec))
        try:
            key = (dtype, *((t.data_ptr(), t._version) for t in parts))
        except RuntimeError:  # inference tensors keep no version counter: no cache
            return column_sq_norms(w, dtype)
        return self._kept("_column_norms", name, key, lambda: column_sq_norms(w, dtype))

    def refresh_column_norms(self) -> None:
        """Bring the cached column norms up to date with the packed buffers."""
        for name, (key, _) in list(vars(self).get("_column_norms", {}).items()):
            self.packed_column_norms(name, key[0])

    def compensation_keep(self, name: str, k: int) -> torch.Tensor:
        """bool [k] (or [E, k]), True at the calibrated static compensation channels held in
        the buffer `name` (`rc_channels`, or an expert stack's `rc_channels_<proj>` [E, n]).
        Kept while that buffer is unchanged; when it changes, recomputed into the same tensor
        (as the column norms), so a captured CUDA graph reads the new channels."""
        from .compensation import channels_mask

        channels = getattr(self, name)
        try:
            key = (k, channels.data_ptr(), channels._version)
        except RuntimeError:  # an inference tensor keeps no version counter: no cache
            return channels_mask(channels, k)
        return self._kept("_keep_masks", name, key, lambda: channels_mask(channels, k))

    def _kept(self, cache: str, name: str, key: tuple, compute) -> torch.Tensor:
        # compute()'s tensor, kept while `key` (key[0]: what it is for, a dtype or a width;
        # then what it was computed from) is unchanged. When only the sources changed, it is
        # recomputed into the same tensor, so that a captured CUDA graph reading it sees the
        # new values; one for another purpose is a new tensor.
        store = vars(self).setdefault(cache, {})
        cached = store.get(name)
        if cached is not None and cached[0] == key:
            return cached[1]
        value = compute()
        if cached is not None and cached[0][0] == key[0]:
            value = cached[1].copy_(value)
        store[name] = (key, value)
        return value
