"""How AdamW4 stores its two moments: one frozen value, the method's defaults unless a study
sets another.

The defaults (rank-1 transform of v, stochastic state rounding, m stored over the root of v,
delayed scaling with headroom 4) were chosen by experiments/study_adamw4_transforms.py and the
`small` pretraining runs; the measurements are in docs/results/optimizers.md. The other values
exist to reproduce that study: AdamW4 takes them only through its keyword `state_format`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .state_transforms import TRANSFORMS

# transform="none" keeps every state in fp32: AdamW4 then computes exactly what torch's AdamW does.
NONE = "none"
ROUNDINGS = ("stochastic", "rne")
FIRST_MOMENTS = ("normalized", "direct")
SCALINGS = ("delayed", "current")
# A param group's key for each field, as AdamW4's state_dict has always saved them.
GROUP_KEYS = {"transform": "transform", "rounding": "state_rounding",
              "first_moment": "first_moment", "scaling": "scaling", "headroom": "headroom"}


@dataclass(frozen=True)
class StateFormat:
    """The encoding of AdamW4's moments (for studies; the defaults are the method).

    transform: how v is stored: "rank1", "sqrt", "pow4", "log", "rsqrt", "v" (raw),
        "sqrt-center-hadamard" (Full-Stack FP4's: sqrt, tensor mean removed, 16-point Hadamard;
        the reference step only), or "none" (fp32 states, torch's AdamW bit for bit); see
        state_transforms.
    rounding: of the stored states: "stochastic" (unbiased, so EMA increments below FP4's
        spacing are not lost; reproducible from AdamW4's seed) or "rne" (round to nearest;
        small increments vanish and states go stale).
    first_moment: "normalized" (m stored as m / sqrt(v read back): O(1) on every coordinate,
        so rows with tiny gradients keep their momentum) or "direct" (m as it is).
    scaling: how each stored moment's tensor scale (amax) is set. "delayed": `headroom` times
        the amax of its stored form at the previous step (the first step measures its own), so
        the fused step needs no reduction before quantizing; a moment that grows more than
        that in one step saturates its largest blocks for that step. "current": the amax of
        the stored form itself.
    headroom: delayed scaling's factor, a finite number >= 1 (a power of two keeps the
        products exact).
    """

    transform: str = "rank1"
    rounding: str = "stochastic"
    first_moment: str = "normalized"
    scaling: str = "delayed"
    headroom: float = 4.0

    def __post_init__(self) -> None:
        if self.transform != NONE and self.transform not in TRANSFORMS:
            raise ValueError(f"StateFormat: unknown transform {self.transform!r}; choose from "
                             f"{[*TRANSFORMS, NONE]}")
        for name, allowed in (("rounding", ROUNDINGS), ("first_moment", FIRST_MOMENTS),
                              ("scaling", SCALINGS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"StateFormat: {name} must be one of {allowed}, got "
                                 f"{getattr(self, name)!r}")
        headroom = self.headroom
        if isinstance(headroom, bool) or not isinstance(headroom, int | float) or not (
                1.0 <= headroom < math.inf):
            raise ValueError(f"StateFormat: headroom must be a finite number >= 1, got "
                             f"{headroom!r}")
        object.__setattr__(self, "headroom", float(headroom))

    @property
    def quantized(self) -> bool:
        """Whether large tensors' moments are stored in NVFP4 (all but transform="none")."""
        return self.transform != NONE

    def unfused_field(self) -> str | None:
        """Why the fused step cannot run this format (it implements the defaults, with any
        headroom), or None."""
        for name in ("transform", "rounding", "first_moment", "scaling"):
            value, wanted = getattr(self, name), getattr(DEFAULT_FORMAT, name)
            if value != wanted:
                return f"the fused step implements only {name}={wanted!r}, got {value!r}"
        return None

    def group_fields(self) -> dict[str, Any]:
        """The fields under a saved param group's keys (AdamW4.state_dict)."""
        return {GROUP_KEYS[name]: value for name, value in asdict(self).items()}

    @classmethod
    def from_saved_groups(cls, groups: list[dict[str, Any]]) -> StateFormat:
        """The format a state_dict's param groups were saved with. Keys a group lacks (saved
        before they existed) take the defaults; groups that disagree are an error."""
        formats = {cls(**{name: g[key] for name, key in GROUP_KEYS.items() if key in g})
                   for g in groups}
        if len(formats) > 1:
            raise ValueError(f"the state_dict's param groups have different state formats "
                             f"{sorted(map(repr, formats))}; AdamW4 holds one for all groups")
        return formats.pop() if formats else cls()


DEFAULT_FORMAT = StateFormat()
