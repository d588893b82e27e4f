"""NVFP4Tensor: packed E2M1 codes, E4M3 block scales, the fp32 global amax and the logical shape."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..files import publish, temp_path
from .spec import QuantSpec

BLOCK = 16
def padded_k(k: int) -> int:
    """Last dim rounded up to a whole number of 16-element blocks."""
    return -(-k // BLOCK) * BLOCK


@dataclass(frozen=True)
class NVFP4Tensor:
    """A tensor quantized to NVFP4.

    data:   uint8 [..., ceil(K/16)*8], two E2M1 codes per byte, even element in the low nibble.
    scales: float8_e4m3fn [..., ceil(K/16)], one per 1x16 block (a 16x16 tile's scale is
            repeated on each of its 16 rows).
    amax:   float32 0-d tensor, the global amax the two-level scale was built from.
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
        if self.amax.dtype != torch.float32 or self.amax.dim() != 0:
            raise ValueError(
                f"NVFP4Tensor.amax must be a float32 0-d tensor, got {self.amax.dtype} "
                f"with shape {tuple(self.amax.shape)}"
            )

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def decode_scale(self) -> torch.Tensor:
        """Global decode scale amax * (1 / (6 * scale_max)) (ModelOpt: weights_scaling_factor_2)."""
        return self.amax * torch.tensor(
            1.0 / (6.0 * self.spec.scale_max), dtype=torch.float32, device=self.amax.device
        )

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scales.numel() + 4

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
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device=str(device)) as f:
            meta = f.metadata() or {}
            if meta.get("format") != "nvfp4":
                raise ValueError(f"{path} is not an fp4stack NVFP4 tensor file (no format=nvfp4)")
            tensors = {k: f.get_tensor(k) for k in ("data", "scales", "amax")}
        spec = json.loads(meta["spec"])
        spec["block"] = tuple(spec["block"])
        return cls(shape=torch.Size(json.loads(meta["shape"])), spec=QuantSpec(**spec), **tensors)
