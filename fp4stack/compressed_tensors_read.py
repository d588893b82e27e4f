"""Reading an nvfp4-pack-quantized checkpoint for `load_quantized`, trusting nothing in it.

Every file is read through `read_safetensors` (a truncated or foreign file is a ValueError naming
it); the entries of `model.safetensors.index.json` must be relative paths inside the checkpoint
directory; fp4stack's header metadata must be well-formed; each layer's tensors must have the
model's shapes and dtypes; global scales must be finite and > 0, amaxes finite and >= 0 and block
scales finite and >= 0 (a NaN or negative one would silently turn outputs NaN or flip their
sign). Every error names the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .formats.spec import QuantSpec
from .formats.tensor import NVFP4Tensor, check_amax, check_block_scales, read_safetensors
from .nn.linear import QuantLinear

WEIGHTS_NAME = "model.safetensors"
META_KEY = "fp4stack.nvfp4"
PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")
RC_KEY = "rc_channels"  # a layer's calibrated QUADS compensation channels, in the metadata


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def weight_spec(layer: QuantLinear) -> QuantSpec:
    return layer.packed_spec or layer.recipe.w


@dataclass
class Checkpoint:
    """The tensors of a checkpoint, the file each came from, and fp4stack's per-layer metadata
    (with the file it came from; empty for checkpoints written by other tools)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    origin: dict[str, Path] = field(default_factory=dict)
    meta: dict[str, tuple[dict[str, Any], Path]] = field(default_factory=dict)
    stored: dict[str, str] = field(default_factory=dict)  # model name -> name in the file

    def where(self, key: str) -> str:
        return f"{self.origin[key]}: {self.stored.get(key, key)}"


def _shards(directory: Path) -> list[Path]:
    """The files to read: the shards an index names (each inside `directory`), or the one file."""
    index = directory / f"{WEIGHTS_NAME}.index.json"
    if not index.exists():
        if not (directory / WEIGHTS_NAME).exists():
            raise FileNotFoundError(f"{directory} holds no {WEIGHTS_NAME} (nor its index)")
        return [directory / WEIGHTS_NAME]
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{index}: not a safetensors index (no JSON object with a "
                         "'weight_map')") from None
    if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: 'weight_map' must map tensor names to file names")
    root = directory.resolve()
    files = []
    for entry in sorted(set(weight_map.values())):
        path = (root / entry).resolve()
        if Path(entry).is_absolute() or not path.is_relative_to(root) or path == root:
            raise ValueError(f"{index}: 'weight_map' entry {entry!r} is not a file inside "
                             f"{directory}; a checkpoint is read only from its own directory")
        files.append(directory / entry)
    return files


def _layer_meta(file: Path, text: str) -> dict[str, dict[str, Any]]:
    where = f"{file}: metadata field {META_KEY!r}"
    try:
        meta = json.loads(text)
    except ValueError:
        raise ValueError(f"{where} is not valid JSON") from None
    if not isinstance(meta, dict) or not all(isinstance(v, dict) for v in meta.values()):
        raise ValueError(f"{where} must map layer names to objects")
    for name, info in meta.items():
        spec = info.get("spec", {})
        if not isinstance(spec, dict) or not isinstance(spec.get("four_over_six", False), bool):
            raise ValueError(f"{where}[{name!r}].spec must be an object with a bool four_over_six")
        for key in ("amax", "x_amax"):
            if key in info and not isinstance(info[key], str):
                raise ValueError(f"{where}[{name!r}].{key} must be a float.hex() string")
        channels = info.get(RC_KEY, [])
        if not isinstance(channels, list) or not all(
                isinstance(c, int) and not isinstance(c, bool) for c in channels):
            raise ValueError(f"{where}[{name!r}].{RC_KEY} must be a list of channel indices")
    return meta


def read_checkpoint(directory: Path) -> Checkpoint:
    """Every tensor of the checkpoint (one file, or the shards of an index) and fp4stack's
    metadata, each checked as far as it can be without the model."""
    ckpt = Checkpoint()
    for file in _shards(directory):
        tensors, header = read_safetensors(file)
        if META_KEY in header:
            ckpt.meta.update({n: (info, file) for n, info in
                              _layer_meta(file, header[META_KEY]).items()})
        ckpt.tensors.update(tensors)
        ckpt.origin.update(dict.fromkeys(tensors, file))
    return ckpt


def _global_scale(ckpt: Checkpoint, key: str) -> torch.Tensor:
    t = ckpt.tensors[key]
    if t.numel() != 1:
        raise ValueError(f"{ckpt.where(key)}: expected one global scale, got shape "
                         f"{tuple(t.shape)}")
    v = t.float().reshape(())
    if not (torch.isfinite(v) and v > 0):
        raise ValueError(f"{ckpt.where(key)} must be finite and > 0, got {v.item()}")
    return v


def _amax(ckpt: Checkpoint, name: str, field_: str, key: str, scale_max: float) -> torch.Tensor:
    info, file = ckpt.meta.get(name, ({}, None))
    scale = _global_scale(ckpt, key)
    if field_ in info:
        where = f"{file}: metadata field {META_KEY!r}[{name!r}].{field_}"
        try:
            amax = torch.tensor(float.fromhex(info[field_]), dtype=torch.float32)
        except ValueError:
            raise ValueError(f"{where} is not a float.hex() string: {info[field_]!r}") from None
    else:
        # Another tool's checkpoint: the amax its encode scale stands for (exact up to one fp32
        # ulp).
        where = f"{ckpt.where(key)} (as an amax)"
        amax = torch.tensor(6.0 * scale_max, dtype=torch.float32) / scale
    check_amax(amax, where)
    return amax


def _expect(ckpt: Checkpoint, key: str, shape: tuple, dtype: torch.dtype) -> None:
    t = ckpt.tensors[key]
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{ckpt.where(key)}: the checkpoint has {t.dtype} {tuple(t.shape)}, "
                         f"the model expects {dtype} {tuple(shape)}")


def layer_tensor(name: str, layer: QuantLinear, ckpt: Checkpoint
                 ) -> tuple[NVFP4Tensor, torch.Tensor | None]:
    """The checked NVFP4 weight of one layer and its activation amax (None when not stored)."""
    return unit_tensor(name, (layer.out_features, layer.in_features), weight_spec(layer), ckpt)


def unit_tensor(name: str, shape: tuple[int, int], spec: QuantSpec, ckpt: Checkpoint
                ) -> tuple[NVFP4Tensor, torch.Tensor | None]:
    """The checked NVFP4 weight stored under `name` (a linear layer, or one projection of one
    expert) of logical `shape` and `spec`, and its activation amax (None when not stored)."""
    n, k = shape
    data, scales, gs = (join(name, s) for s in PACKED_SUFFIXES)
    _expect(ckpt, data, (n, k // 2), torch.uint8)
    _expect(ckpt, scales, (n, k // 16), torch.float8_e4m3fn)
    check_block_scales(ckpt.tensors[scales], ckpt.where(scales))
    info, file = ckpt.meta.get(name, ({}, None))
    if "spec" in info and info["spec"].get("four_over_six", False) != spec.four_over_six:
        raise ValueError(f"{file}: layer {name!r}: the checkpoint's four_over_six="
                         f"{info['spec'].get('four_over_six', False)} differs from the model's "
                         f"{spec.four_over_six}, which changes the meaning of its scales")
    amax = _amax(ckpt, name, "amax", gs, spec.scale_max)
    t = NVFP4Tensor(ckpt.tensors[data], ckpt.tensors[scales], amax, torch.Size((n, k)), spec)
    x_key = join(name, "input_global_scale")
    x_amax = _amax(ckpt, name, "x_amax", x_key, 448.0) if x_key in ckpt.tensors else None
    return t, x_amax


def compensation_channels(name: str, k: int, ckpt: Checkpoint) -> torch.Tensor | None:
    """The compensation channels stored for layer `name` (int64, ascending), checked to be
    distinct indices in [0, k); None when the checkpoint has none for it."""
    info, file = ckpt.meta.get(name, ({}, None))
    if RC_KEY not in info:
        return None
    channels = info[RC_KEY]
    if len(set(channels)) != len(channels) or not all(0 <= c < k for c in channels):
        raise ValueError(f"{file}: metadata field {META_KEY!r}[{name!r}].{RC_KEY} must hold "
                         f"distinct channel indices in [0, {k}), got {channels[:8]}"
                         f"{' ...' if len(channels) > 8 else ''}")
    return torch.tensor(sorted(channels), dtype=torch.int64)


def mapped(names: dict[str, str], key: str) -> str:
    """`key` renamed by `names`, which maps tensor names, and layer names whose tensors are
    `<layer>.<suffix>`; a key it does not cover stays as it is."""
    if key in names:
        return names[key]
    prefix, dot, suffix = key.rpartition(".")
    return f"{names[prefix]}.{suffix}" if dot and prefix in names else key


def rename(ckpt: Checkpoint, to_model: dict[str, str]) -> None:
    """Key the checkpoint's tensors and metadata by the model's names (`to_model`, see
    `mapped`), in place; names it lacks stay as they are (and are then reported as
    unexpected). Errors still name a tensor as the file does."""
    ckpt.stored = {mapped(to_model, k): k for k in ckpt.tensors}
    ckpt.tensors = {mapped(to_model, k): v for k, v in ckpt.tensors.items()}
    ckpt.origin = {mapped(to_model, k): v for k, v in ckpt.origin.items()}
    ckpt.meta = {to_model.get(k, k): v for k, v in ckpt.meta.items()}
