"""NVFP4Tensor: packed E2M1 codes, E4M3 block scales, the fp32 global amax and the logical shape."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..files import publish, temp_path
from .global_scale import global_decode_scale
from .spec import QuantSpec

BLOCK = 16


def padded_k(k: int) -> int:
    """Last dim rounded up to a whole number of 16-element blocks."""
    return -(-k // BLOCK) * BLOCK


def amax_shape(shape: tuple[int, ...], spec: QuantSpec) -> tuple[int, ...]:
    """The shape of the global amax of a tensor of `shape`: () per tensor, (*lead, 1) per row."""
    return (*shape[:-1], 1) if spec.row_scaled else ()


@dataclass(frozen=True)
class NVFP4Tensor:
    """A tensor quantized to NVFP4.

    data:   uint8 [..., ceil(K/16)*8], two E2M1 codes per byte, even element in the low nibble.
    scales: float8_e4m3fn [..., ceil(K/16)], one per 1x16 block (a 16x16 tile's scale is
            repeated on each of its 16 rows).
    amax:   float32, the global amax the two-level scale was built from: 0-d, or [..., 1] (one
            per row) for a row-scaled spec (QuantSpec.global_scale="row").
    shape:  the logical shape of the quantized tensor (padding removed on dequantize).
    spec:   how it was quantized (block shape, transform, 4/6), needed to read it back.

    `fp4stack.dequantize(t, dtype)` reads the values back, with the backend for t's device.
    """

    data: torch.Tensor
    scales: torch.Tensor
    amax: torch.Tensor
    shape: torch.Size
    spec: QuantSpec

    def __post_init__(self) -> None:
        shape = torch.Size(self.shape)
        object.__setattr__(self, "shape", shape)
        if len(shape) == 0:
            raise ValueError("NVFP4Tensor.shape must have at least one dim")
        kb = padded_k(shape[-1]) // BLOCK
        want_data = (*shape[:-1], kb * BLOCK // 2)
        want_scales = (*shape[:-1], kb)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want_data:
            raise ValueError(
                f"NVFP4Tensor.data must be uint8 of shape {want_data} for logical shape "
                f"{tuple(shape)}, got {self.data.dtype} {tuple(self.data.shape)}"
            )
        if self.scales.dtype != torch.float8_e4m3fn or tuple(self.scales.shape) != want_scales:
            raise ValueError(
                f"NVFP4Tensor.scales must be float8_e4m3fn of shape {want_scales}, got "
                f"{self.scales.dtype} {tuple(self.scales.shape)}"
            )
        want_amax = amax_shape(shape, self.spec)
        if self.amax.dtype != torch.float32 or tuple(self.amax.shape) != want_amax:
            kind = "[..., 1] (one per row)" if self.spec.row_scaled else "0-d"
            raise ValueError(
                f"NVFP4Tensor.amax must be a float32 {kind} tensor of shape {want_amax}, got "
                f"{self.amax.dtype} with shape {tuple(self.amax.shape)}"
            )

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def decode_scale(self) -> torch.Tensor:
        """Global decode scale amax * (1 / (6 * scale_max)) (ModelOpt: weights_scaling_factor_2);
        2^-128 where the encode scale was capped (`global_decode_scale`)."""
        return global_decode_scale(self.amax, self.spec.scale_max)

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scales.numel() + 4 * self.amax.numel()

    def to(self, device: torch.device | str) -> NVFP4Tensor:
        return replace(
            self,
            data=self.data.to(device),
            scales=self.scales.to(device),
            amax=self.amax.to(device),
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"data": self.data, "scales": self.scales, "amax": self.amax}

    def metadata(self) -> dict[str, str]:
        return {
            "format": "nvfp4",
            "shape": json.dumps(list(self.shape)),
            "spec": json.dumps(self.spec.to_dict()),
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write to a safetensors file atomically (a crash never leaves a half-written file; its
        temporary file is removed by the next save), with the umask's mode."""
        from safetensors.torch import save_file

        path = Path(path)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        tmp = temp_path(path)
        try:
            save_file(tensors, str(tmp), metadata=self.metadata())
            publish(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike, device: torch.device | str = "cpu") -> NVFP4Tensor:
        """Read a file written by `save`, checking everything it holds before use (ValueError
        naming the file and the field: not a safetensors file, no fp4stack metadata, wrong
        shapes or dtypes, a NaN, infinite or negative amax or block scale)."""
        tensors, meta = read_safetensors(path, device=device)
        if meta.get("format") != "nvfp4":
            raise ValueError(f"{path} is not an fp4stack NVFP4 tensor file (no format=nvfp4)")
        spec = _meta_field(path, meta, "spec", dict)
        if isinstance(spec.get("block"), list):
            spec["block"] = tuple(spec["block"])
        try:
            spec = QuantSpec(**spec)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: invalid metadata field 'spec': {e}") from None
        if spec.format != "nvfp4":
            raise ValueError(f"{path}: metadata field 'spec' has format={spec.format!r}, "
                             "expected 'nvfp4'")
        shape = _meta_field(path, meta, "shape", list)
        if not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"{path}: metadata field 'shape' must be a list of sizes, got {shape}")
        missing = sorted({"data", "scales", "amax"} - set(tensors))
        if missing:
            raise ValueError(f"{path}: missing tensors {missing}")
        try:
            t = cls(shape=torch.Size(shape), spec=spec,
                    **{k: tensors[k] for k in ("data", "scales", "amax")})
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        check_amax(t.amax, f"{path}: amax")
        check_block_scales(t.scales, f"{path}: scales")
        return t


def read_safetensors(path: str | os.PathLike, device: torch.device | str = "cpu"
                     ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a safetensors file and its header metadata; a file that is not one (or
    is truncated) raises ValueError naming it, a missing one FileNotFoundError."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}  # noqa: SIM118
    except FileNotFoundError:
        raise FileNotFoundError(f"no such file: {path}") from None
    except (SafetensorError, OSError) as e:
        raise ValueError(f"not a safetensors file or truncated: {path} ({e})") from None


def _meta_field(path: str | os.PathLike, meta: dict[str, str], key: str, kind: type):
    try:
        value = json.loads(meta[key])
    except KeyError:
        raise ValueError(f"{path}: metadata field {key!r} is missing") from None
    except ValueError:
        raise ValueError(f"{path}: metadata field {key!r} is not valid JSON") from None
    if not isinstance(value, kind):
        raise ValueError(f"{path}: metadata field {key!r} must be a {kind.__name__}, got "
                         f"{type(value).__name__}")
    return value


def check_amax(amax: torch.Tensor, where: str) -> None:
    """Refuse a global amax read from a file unless finite and >= 0 (a NaN or negative one would
    turn every value NaN or flip its sign); `where` names the file and the field."""
    bad = amax[~(torch.isfinite(amax) & (amax >= 0))]
    if bad.numel():
        raise ValueError(f"{where} must be finite and >= 0, got {bad.flatten()[0].item()}")


def check_block_scales(scales: torch.Tensor, where: str) -> None:
    """Refuse E4M3 block scales read from a file unless all are finite (E4M3 has NaN, no Inf)
    and >= 0."""
    s = scales.float()
    bad = ~(torch.isfinite(s) & (s >= 0))
    if bad.any():
        i = tuple(int(j) for j in bad.nonzero()[0])
        raise ValueError(f"{where} must be finite and >= 0, got {s[i].item()} at index {i}")
