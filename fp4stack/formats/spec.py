"""QuantSpec: one named way of quantizing one tensor to NVFP4.

Every entry point (reference, Triton kernels, layers, recipes) takes its options from a QuantSpec,
so the options are validated in one place and a recipe can be written down as data.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

Rounding = Literal["rne", "stochastic"]
NanPolicy = Literal["raise", "propagate"]

_ROUNDINGS = ("rne", "stochastic")
_BLOCKS = ((1, 16), (16, 16))
_NAN_POLICIES = ("raise", "propagate")


@dataclass(frozen=True)
class QuantSpec:
    """How to quantize one tensor to NVFP4.

    block:         (1, 16) blocks along the last dim, or (16, 16) tiles over the last two dims.
    rounding:      "rne" (round to nearest even) or "stochastic" (unbiased, reproducible by seed).
    hadamard:      apply the 16-point random Hadamard transform to each block before quantizing.
    four_over_six: per block, also try mapping the block max to 4 and keep the lower-MSE choice.
    nan_policy:    "raise" a ValueError on NaN/Inf input, or "propagate" (no check, no sync).
    """

    block: tuple[int, int] = (1, 16)
    rounding: Rounding = "rne"
    hadamard: bool = False
    four_over_six: bool = False
    nan_policy: NanPolicy = "raise"

    def __post_init__(self) -> None:
        block = tuple(self.block) if isinstance(self.block, (list, tuple)) else self.block
        if block not in _BLOCKS:
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
        if self.hadamard and self.block != (1, 16):
            raise ValueError(
                "QuantSpec.hadamard=True needs block=(1, 16): the transform mixes the 16 elements "
                "of a row block, which would break the shared scale of a 16x16 tile"
            )

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
