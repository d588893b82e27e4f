"""Recipe: which QuantSpec each GEMM operand of a linear layer gets. Data, not code paths.

For y = x Wᵀ (x [T, K], W [N, K]) a layer runs three GEMMs:
    fprop  y  = Q(x) Q(W)ᵀ           x and W quantized along K
    dgrad  dx = Q(dy) Q(W)           dy along N, W along N (columnwise)
    wgrad  dW = Q(dyᵀ) Q(xᵀ)ᵀ        dy and x along T (columnwise)
A backward operand of `None` reuses the forward's quantized tensor (exact for 16x16 weight tiles,
and what a fake-quantized trainer's autograd does); `QuantSpec.none()` uses the unquantized one.
The named recipes are in fp4stack.nn.recipe; this module holds only the types.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from ..formats.spec import QuantSpec
from .attention_quant import AttentionQuant

WeightStorage = Literal["master", "packed"]


@dataclass(frozen=True)
class ResidualCompensation:
    """QUADS activation residual compensation: y += (x - Q(x))[:, C] Q(W)[:, C]ᵀ.

    k: channels corrected, a count (int >= 1) or a fraction of K (float in (0, 1]).
    mode: "dynamic" picks C per batch by residual energy; "static" uses channels calibrated
          per layer (`QuantLinear.calibrate`), falling back to dynamic until calibrated.
    """

    k: int | float = 0.05
    mode: Literal["dynamic", "static"] = "dynamic"

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not (
            (isinstance(self.k, int) and self.k >= 1)
            or (isinstance(self.k, float) and 0.0 < self.k <= 1.0)
        ):
            raise ValueError(
                f"ResidualCompensation.k must be an int >= 1 or a float in (0, 1], got {self.k!r}"
            )
        if self.mode not in ("dynamic", "static"):
            raise ValueError(f"ResidualCompensation.mode must be 'dynamic' or 'static', "
                             f"got {self.mode!r}")

    def count(self, channels: int) -> int:
        if isinstance(self.k, int):
            return min(self.k, channels)
        return max(1, min(channels, round(self.k * channels)))


LowRankFit = Literal["error", "weight"]
_FITS = ("error", "weight")


@dataclass(frozen=True)
class LowRank:
    """Full-Stack FP4's low-rank part of a linear layer, of rank r, refitted every
    `refresh_every` training forwards (0: never), or trained.

    fit="error": a branch fitted to the quantization error, y += (x Aᵀ) Bᵀ with B A the
        truncated SVD of W - Q(W) (nn/lowrank.py).
    fit="weight": SVDQuant's split, y = x Lᵀ + Q(x) Q(W - L)ᵀ with L W's principal rank-r part
        (randomized SVD) in high precision and only the residual quantized (nn/lowrank_split.py);
        L is a function of W, so it is never trained on its own.
    """

    rank: int = 16
    refresh_every: int = 100
    trainable: bool = False
    fit: LowRankFit = "error"

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LowRank.rank must be >= 1, got {self.rank}")
        if self.refresh_every < 0:
            raise ValueError(f"LowRank.refresh_every must be >= 0, got {self.refresh_every}")
        if self.fit not in _FITS:
            raise ValueError(f"LowRank.fit must be one of {_FITS} (the quantization error's "
                             f"branch, or the weight's split), got {self.fit!r}")
        if self.fit == "weight" and self.trainable:
            raise ValueError("LowRank.trainable=True trains a branch of its own, and "
                             "fit='weight' splits W itself (its principal part follows W): "
                             "use fit='error' to train the pair, or trainable=False")


_NONE = QuantSpec.none()
# The GEMM operands of a linear layer, in the order fprop, dgrad, wgrad.
LINEAR_OPERANDS = ("x", "w", "dy", "w_dgrad", "x_wgrad", "dy_wgrad")
# The backward operands for which None means "reuse the forward's quantized tensor".
_REUSING = ("w_dgrad", "x_wgrad")


@dataclass(frozen=True)
class Recipe:
    """The QuantSpec of every GEMM operand of a linear layer, and the layer-level options.

    keep_first_blocks / keep_last_blocks: transformer blocks left in high precision (applied by
    `quantize_model`). activation_amax: "dynamic" (each tensor's own) or "static" (calibrated).
    """

    name: str
    x: QuantSpec = _NONE
    w: QuantSpec = _NONE
    dy: QuantSpec = _NONE
    w_dgrad: QuantSpec | None = None
    x_wgrad: QuantSpec | None = None
    dy_wgrad: QuantSpec = _NONE
    weight_storage: WeightStorage = "master"
    activation_amax: Literal["dynamic", "static"] = "dynamic"
    keep_first_blocks: int = 0
    keep_last_blocks: int = 0
    compensation: ResidualCompensation | None = None
    lowrank: LowRank | None = None
    attention: AttentionQuant | None = None  # FP4 attention in fp4stack GPT blocks
    optimizer_states: Literal["fp32", "nvfp4"] = "fp32"  # nvfp4: AdamW4 / Muon4 in training
    # How AdamW4 stores v for this recipe (optim.state_transforms; None: AdamW4's default); a
    # training config's adamw4_transform, when set, overrides it.
    adamw4_transform: str | None = None

    def __post_init__(self) -> None:
        for name in LINEAR_OPERANDS:
            spec = getattr(self, name)
            if not isinstance(spec, QuantSpec) and not (spec is None and name in _REUSING):
                allowed = "a QuantSpec or None (reuse the forward's)" if name in _REUSING \
                    else "a QuantSpec (QuantSpec.none() for unquantized)"
                raise TypeError(f"Recipe.{name} must be {allowed}, got {spec!r}; e.g. "
                                f"QuantSpec(block=(16, 16)) or QuantSpec.fp8('block128')")
        if self.weight_storage not in ("master", "packed"):
            raise ValueError(f"Recipe.weight_storage must be 'master' or 'packed', "
                             f"got {self.weight_storage!r}")
        if self.weight_storage == "packed" and self.w.format != "nvfp4":
            raise ValueError("Recipe.weight_storage='packed' needs an NVFP4 weight spec (Recipe.w)")
        if self.weight_storage == "packed" and self.w_dgrad is not None:
            raise ValueError("Recipe.weight_storage='packed' keeps no master weight to quantize "
                             "for dgrad: leave Recipe.w_dgrad as None (reuse the packed weight)")
        if self.activation_amax not in ("dynamic", "static"):
            raise ValueError(f"Recipe.activation_amax must be 'dynamic' or 'static', "
                             f"got {self.activation_amax!r}")
        for name in ("w", "w_dgrad"):
            spec = getattr(self, name)
            if spec is not None and spec.row_scaled:
                raise ValueError(f"Recipe.{name}: global_scale='row' is a per-token scale for "
                                 "activations and gradients; a weight keeps one global scale "
                                 "(packed GEMMs, checkpoints and shared q/k/v scales read one)")
        if self.activation_amax == "static" and self.x.row_scaled:
            raise ValueError("Recipe.activation_amax='static' calibrates one amax for Recipe.x, "
                             "which has global_scale='row' (each token's own): use 'dynamic'")
        if self.compensation is not None and self.x.format == "none":
            raise ValueError("Recipe.compensation corrects activation quantization error, but "
                             "Recipe.x is not quantized")
        for name in ("x", "w", "dy", "w_dgrad"):
            spec = getattr(self, name)
            if spec is not None and spec.hadamard:
                raise ValueError(f"Recipe.{name}: the Hadamard transform belongs on the wgrad "
                                 "operands (x_wgrad and dy_wgrad), where it cancels")
        had = [s is not None and s.hadamard for s in (self.x_wgrad, self.dy_wgrad)]
        if had[0] != had[1]:
            raise ValueError("Recipe.x_wgrad and Recipe.dy_wgrad must both use hadamard or "
                             "neither: the transform cancels only between two operands")
        if self.optimizer_states not in ("fp32", "nvfp4"):
            raise ValueError(f"Recipe.optimizer_states must be 'fp32' or 'nvfp4', "
                             f"got {self.optimizer_states!r}")
        if self.adamw4_transform is not None and self.optimizer_states != "nvfp4":
            raise ValueError(f"Recipe.adamw4_transform={self.adamw4_transform!r} is for NVFP4 "
                             "optimizer states: set Recipe.optimizer_states='nvfp4' too")
        if self.attention is not None and not isinstance(self.attention, AttentionQuant):
            raise ValueError("Recipe.attention must be an AttentionQuant (or None)")
        if self.lowrank is not None and self.lowrank.fit == "weight" and (
                self.weight_storage == "packed" or self.w.format == "none"):
            raise ValueError("Recipe.lowrank with fit='weight' quantizes W - L in the forward "
                             "from a master weight: it needs an NVFP4 (or FP8) Recipe.w and "
                             "weight_storage='master'")
        if self.keep_first_blocks < 0 or self.keep_last_blocks < 0:
            raise ValueError("Recipe.keep_first_blocks and keep_last_blocks must be >= 0")

    @property
    def quantizes(self) -> bool:
        ops = [getattr(self, name) for name in LINEAR_OPERANDS]
        return any(s is not None and s.format != "none" for s in ops)

    def with_(self, **changes) -> Recipe:
        """A copy with some fields changed (e.g. recipe("w4a4-rc").with_(compensation=...))."""
        return replace(self, **changes)
