"""QuantSpec: one named way of quantizing one tensor (NVFP4, an FP8 baseline, or not at all).

Every entry point (reference, Triton kernels, layers, recipes) takes its options from a QuantSpec,
so the options are validated in one place and a recipe can be written down as data.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

Rounding = Literal["rne", "stochastic"]
NanPolicy = Literal["raise", "propagate"]
Format = Literal["nvfp4", "fp8", "none"]
GlobalScale = Literal["tensor", "row"]

_ROUNDINGS = ("rne", "stochastic")
_BLOCKS = ((1, 16), (16, 16))
_NAN_POLICIES = ("raise", "propagate")
_FORMATS = ("nvfp4", "fp8", "none")
_GLOBAL_SCALES = ("tensor", "row")
# FP8 block shapes, -1 meaning a whole dim: per-tensor, per-row, 1x128 blocks.
_FP8_BLOCKS = {(-1, -1): "tensor", (1, -1): "row", (1, 128): "block128"}


@dataclass(frozen=True)
class QuantSpec:
    """How to quantize one tensor.

    format:        "nvfp4" (the default), "fp8" (E4M3 baseline) or "none" (left as it is).
    block:         NVFP4: (1, 16) blocks along the last dim, or (16, 16) tiles over the last two
                   dims. FP8: (-1, -1) per tensor, (1, -1) per row, (1, 128) blocks.
    rounding:      "rne" (round to nearest even) or "stochastic" (unbiased, reproducible by seed).
    hadamard:      apply the 16-point random Hadamard transform to each block before quantizing.
    four_over_six: per block, also try mapping the block max to 4 and keep the lower-MSE choice.
    nan_policy:    "raise" a ValueError on NaN/Inf input, or "propagate" (no check, no sync).
    global_scale:  NVFP4's second-level FP32 scale: one per "tensor" (the standard), or one per
                   "row" along the last dim (per-token activation scaling: each token's amax,
                   so no token's outlier coarsens another's blocks; 1x16 blocks only).
    """

    block: tuple[int, int] = (1, 16)
    rounding: Rounding = "rne"
    hadamard: bool = False
    four_over_six: bool = False
    nan_policy: NanPolicy = "raise"
    format: Format = "nvfp4"
    global_scale: GlobalScale = "tensor"

    def __post_init__(self) -> None:
        block = tuple(self.block) if isinstance(self.block, (list, tuple)) else self.block
        if self.format not in _FORMATS:
            raise ValueError(f"QuantSpec.format must be one of {_FORMATS}, got {self.format!r}")
        if self.format == "fp8":
            self._check_fp8(block)
        elif self.format == "nvfp4" and block not in _BLOCKS:
            raise ValueError(
                f"QuantSpec.block must be (1, 16) or (16, 16), got {self.block!r}; "
                "use (16, 16) for 2D weight tiles and (1, 16) otherwise"
            )
        object.__setattr__(self, "block", block)
        if self.rounding not in _ROUNDINGS:
            raise ValueError(
                f"QuantSpec.rounding must be one of {_ROUNDINGS}, got {self.rounding!r}"
            )
        if self.nan_policy not in _NAN_POLICIES:
            raise ValueError(
                f"QuantSpec.nan_policy must be one of {_NAN_POLICIES}, got {self.nan_policy!r}"
            )
        for name in ("hadamard", "four_over_six"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"QuantSpec.{name} must be a bool, got {getattr(self, name)!r}")
        if self.global_scale not in _GLOBAL_SCALES:
            raise ValueError(f"QuantSpec.global_scale must be one of {_GLOBAL_SCALES}, got "
                             f"{self.global_scale!r}")
        if self.row_scaled and (self.format != "nvfp4" or self.block != (1, 16)):
            raise ValueError(
                "QuantSpec.global_scale='row' needs format='nvfp4' with block=(1, 16): a 16x16 "
                "tile spans 16 rows, and FP8 has its own per-row scaling (QuantSpec.fp8('row'))"
            )
        if self.hadamard and self.block != (1, 16):
            raise ValueError(
                "QuantSpec.hadamard=True needs block=(1, 16): the transform mixes the 16 elements "
                "of a row block, which would break the shared scale of a 16x16 tile"
            )

    def _check_fp8(self, block) -> None:
        if block not in _FP8_BLOCKS:
            raise ValueError(
                f"QuantSpec.block for format='fp8' must be one of {list(_FP8_BLOCKS)} "
                f"(per tensor, per row, 1x128), got {self.block!r}; QuantSpec.fp8() builds one"
            )
        if self.rounding != "rne" or self.hadamard or self.four_over_six:
            raise ValueError(
                "QuantSpec with format='fp8' supports rounding='rne' only, without hadamard or "
                "four_over_six"
            )

    @classmethod
    def fp8(cls, granularity: str = "tensor") -> QuantSpec:
        """The FP8 E4M3 baseline with "tensor", "row" or "block128" scales."""
        blocks = {v: k for k, v in _FP8_BLOCKS.items()}
        if granularity not in blocks:
            raise ValueError(f"granularity must be one of {list(blocks)}, got {granularity!r}")
        return cls(format="fp8", block=blocks[granularity])

    @classmethod
    def none(cls) -> QuantSpec:
        """Leave the tensor unquantized."""
        return cls(format="none")

    @property
    def fp8_granularity(self) -> str:
        return _FP8_BLOCKS[self.block]

    @property
    def row_scaled(self) -> bool:
        """One global scale per row (global_scale="row") instead of one per tensor."""
        return self.global_scale == "row"

    @property
    def is_2d(self) -> bool:
        return self.block == (16, 16)

    @property
    def scale_max(self) -> float:
        """E4M3 block scale the tensor max is mapped to (448, or 256 for 4/6)."""
        return 256.0 if self.four_over_six else 448.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["block"] = list(self.block)
        return d
