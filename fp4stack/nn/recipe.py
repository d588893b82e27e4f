"""Recipe: which QuantSpec each GEMM operand of a linear layer gets. Data, not code paths.

For y = x Wᵀ (x [T, K], W [N, K]) a layer runs three GEMMs:
    fprop  y  = Q(x) Q(W)ᵀ           x and W quantized along K
    dgrad  dx = Q(dy) Q(W)           dy along N, W along N (columnwise)
    wgrad  dW = Q(dyᵀ) Q(xᵀ)ᵀ        dy and x along T (columnwise)
A backward operand of `None` reuses the forward's quantized tensor (exact for 16x16 weight tiles,
and what a fake-quantized trainer's autograd does); `QuantSpec.none()` uses the unquantized one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from ..formats.spec import QuantSpec
from .attention import AttentionQuant
from .attention_quant import NVFP4_SR

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


@dataclass(frozen=True)
class LowRank:
    """Full-Stack FP4 low-rank branch: y += (x Aᵀ) Bᵀ, A and B of rank r from a truncated SVD of
    W - Q(W), refreshed every `refresh_every` training forwards (0: never), or trained."""

    rank: int = 16
    refresh_every: int = 100
    trainable: bool = False

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LowRank.rank must be >= 1, got {self.rank}")
        if self.refresh_every < 0:
            raise ValueError(f"LowRank.refresh_every must be >= 0, got {self.refresh_every}")


_NONE = QuantSpec.none()
_LINEAR_OPERANDS = ("x", "w", "dy", "w_dgrad", "x_wgrad", "dy_wgrad")


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

    def __post_init__(self) -> None:
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
        if self.attention is not None and not isinstance(self.attention, AttentionQuant):
            raise ValueError("Recipe.attention must be an AttentionQuant (or None)")
        if self.keep_first_blocks < 0 or self.keep_last_blocks < 0:
            raise ValueError("Recipe.keep_first_blocks and keep_last_blocks must be >= 0")

    @property
    def quantizes(self) -> bool:
        ops = [getattr(self, name) for name in _LINEAR_OPERANDS]
        return any(s is not None and s.format != "none" for s in ops)

    def with_(self, **changes) -> Recipe:
        """A copy with some fields changed (e.g. recipe("w4a4-rc").with_(compensation=...))."""
        return replace(self, **changes)


def _nvfp4(**kw) -> QuantSpec:
    # Layers run on hot paths: no per-call NaN check (a host sync); training checks the loss.
    return QuantSpec(nan_policy="propagate", **kw)


def _presets() -> dict[str, Recipe]:
    rne = _nvfp4()
    fp8 = QuantSpec.fp8("block128")
    nvfp4 = Recipe("nvfp4", x=rne, w=rne, dy=rne, w_dgrad=rne, x_wgrad=rne, dy_wgrad=rne)
    w4a4 = Recipe("w4a4", x=rne, w=rne, weight_storage="packed")
    # Full-Stack FP4: lowrank linears, NVFP4 optimizer states, FP4 attention with reuse.
    fullstack = nvfp4.with_(name="fullstack", lowrank=LowRank(), optimizer_states="nvfp4",
                            attention=AttentionQuant.paper())
    # NVIDIA's quantizers (arXiv 2509.25149): 2D weights, stochastic rounding of gradients, a
    # 16-point random Hadamard transform on the wgrad operands; here on every block.
    nvidia = Recipe(
        "nvfp4-nvidia",
        x=rne,
        w=_nvfp4(block=(16, 16)),
        dy=_nvfp4(rounding="stochastic"),
        w_dgrad=None,  # 16x16 tiles: Q(W)ᵀ is Q(Wᵀ), so the forward's weight is reused
        x_wgrad=_nvfp4(hadamard=True),
        dy_wgrad=_nvfp4(hadamard=True, rounding="stochastic"),
    )
    fullstack_nvidia = fullstack.with_(
        name="fullstack-nvidia", **{f: getattr(nvidia, f) for f in _LINEAR_OPERANDS})
    noreuse_nvidia = fullstack_nvidia.with_(name="fullstack-nvidia-noreuse",
                                            attention=AttentionQuant(reuse=False))
    return {
        "bf16": Recipe("bf16"),
        "fp8": Recipe("fp8", x=fp8, w=fp8, dy=fp8, w_dgrad=fp8, x_wgrad=fp8, dy_wgrad=fp8),
        "nvfp4": nvfp4,
        # NVIDIA's recipe keeps some blocks in BF16 (here the first and the last).
        "nvfp4-nvidia": nvidia.with_(keep_first_blocks=1, keep_last_blocks=1),
        "lowrank": nvfp4.with_(name="lowrank", lowrank=LowRank()),
        "lowrank-nvidia": nvidia.with_(name="lowrank-nvidia", lowrank=LowRank()),
        "fullstack": fullstack,
        # The attention ablations: the backward re-quantizes Q, K, V instead of reusing the
        # forward's; dS kept in high precision.
        "fullstack-noreuse": fullstack.with_(name="fullstack-noreuse",
                                             attention=AttentionQuant(reuse=False)),
        "fullstack-ds-hp": fullstack.with_(name="fullstack-ds-hp",
                                           attention=AttentionQuant(ds=None)),
        # The full stack on NVIDIA's linear quantizers (every GEMM still NVFP4), and the
        # ablation of its attention's tensor reuse: none, and V̂ only or Q̂, K̂ only.
        "fullstack-nvidia": fullstack_nvidia,
        "fullstack-nvidia-noreuse": noreuse_nvidia,
        "fullstack-nvidia-reuse-v": fullstack_nvidia.with_(
            name="fullstack-nvidia-reuse-v", attention=AttentionQuant(reuse=("v",))),
        "fullstack-nvidia-reuse-qk": fullstack_nvidia.with_(
            name="fullstack-nvidia-reuse-qk", attention=AttentionQuant(reuse=("q", "k"))),
        # Reuse as a native NVFP4 GEMM can take it: the forward's Q̂, K̂, V̂ re-quantized along
        # each backward GEMM's reduction dim (a second rounding).
        "fullstack-nvidia-reblock": fullstack_nvidia.with_(
            name="fullstack-nvidia-reblock", attention=AttentionQuant(reblock=True)),
        # Q, K, V in 16x16 tiles (tokens x head_dim), blocks along both dims at once: one
        # quantization the backward reuses that every GEMM, native ones too, can take.
        "fullstack-nvidia-tiles": fullstack_nvidia.with_(
            name="fullstack-nvidia-tiles",
            attention=AttentionQuant.tiled()),
        # Q and K Hadamard-rotated along head_dim before quantization (QKᵀ unchanged; outliers
        # spread over their 16-block, so fewer small values round to zero), with and without reuse.
        "fullstack-nvidia-rotated": fullstack_nvidia.with_(
            name="fullstack-nvidia-rotated", attention=AttentionQuant(rotate_qk=True)),
        "fullstack-nvidia-rotated-noreuse": fullstack_nvidia.with_(
            name="fullstack-nvidia-rotated-noreuse",
            attention=AttentionQuant(rotate_qk=True, reuse=False)),
        # Why no reuse beats reuse: fresh stochastic rounding of the unquantized Q, K, V in the
        # forward's own block dims (only the rounding differs from reuse), and along each
        # backward GEMM's reduction dims (as no reuse, with stochastic rounding).
        "fullstack-nvidia-fresh-sr": fullstack_nvidia.with_(
            name="fullstack-nvidia-fresh-sr",
            attention=AttentionQuant(reuse=False, requantize_along="forward",
                                     requantize_rounding="stochastic")),
        "fullstack-nvidia-noreuse-sr": fullstack_nvidia.with_(
            name="fullstack-nvidia-noreuse-sr",
            attention=AttentionQuant(reuse=False, requantize_rounding="stochastic")),
        # Whether sharing the forward's rounding hurts even when that rounding is random from
        # step to step: Q, K, V stochastically rounded in the forward, reused or re-quantized
        # (fresh draws along each backward GEMM's reduction dims).
        "fullstack-nvidia-sr-qkv": fullstack_nvidia.with_(
            name="fullstack-nvidia-sr-qkv",
            attention=AttentionQuant(q=NVFP4_SR, k=NVFP4_SR, v=NVFP4_SR)),
        "fullstack-nvidia-sr-qkv-noreuse": fullstack_nvidia.with_(
            name="fullstack-nvidia-sr-qkv-noreuse",
            attention=AttentionQuant(q=NVFP4_SR, k=NVFP4_SR, v=NVFP4_SR, reuse=False)),
        # No reuse with dS = P ∘ (dP - rowsum(P ∘ dP)), the softmax's gradient of the backward's
        # own dP: every row of dS sums to zero as with reuse (the copy task's stability), while
        # the operands stay re-quantized along each GEMM's reduction dim.
        "fullstack-nvidia-noreuse-delta": fullstack_nvidia.with_(
            name="fullstack-nvidia-noreuse-delta",
            attention=AttentionQuant(reuse=False, delta="dp")),
        # The linears' share of the best full stack's gap, two ways to shrink it while every
        # GEMM stays NVFP4: the low-rank pair trained with the model (initialised from the SVD
        # of W - Q(W), never refitted), and Four Over Six scales on the forward's x and W.
        "fullstack-nvidia-noreuse-lora": noreuse_nvidia.with_(
            name="fullstack-nvidia-noreuse-lora", lowrank=LowRank(trainable=True)),
        "fullstack-nvidia-noreuse-4over6": noreuse_nvidia.with_(
            name="fullstack-nvidia-noreuse-4over6", x=_nvfp4(four_over_six=True),
            w=_nvfp4(block=(16, 16), four_over_six=True)),
        # The forward's quantization is that gap (`@forward` against `@backward`), and its 16x16
        # weight tiles cost error a 1x16 block along K does not: W in 1x16 blocks in fprop, and
        # quantized again along N for dgrad; then Four Over Six on those blocks and on x.
        "fullstack-nvidia-noreuse-w1x16": noreuse_nvidia.with_(
            name="fullstack-nvidia-noreuse-w1x16", w=rne, w_dgrad=rne),
        "fullstack-nvidia-noreuse-w1x16-4over6": noreuse_nvidia.with_(
            name="fullstack-nvidia-noreuse-w1x16-4over6", x=_nvfp4(four_over_six=True),
            w=_nvfp4(four_over_six=True), w_dgrad=rne),
        # Not "everything in FP4": the last block (its linears and attention) kept in BF16, as
        # NVIDIA's recipe keeps about 15% of the linears, mostly in the last blocks (1 of 8 here).
        "fullstack-nvidia-noreuse-last-bf16": noreuse_nvidia.with_(
            name="fullstack-nvidia-noreuse-last-bf16", keep_last_blocks=1),
        # No reuse the naive way: the backward on the unquantized Q, K, V (dS still NVFP4).
        "fullstack-nvidia-hp-backward": fullstack_nvidia.with_(
            name="fullstack-nvidia-hp-backward",
            attention=AttentionQuant(reuse=False, requantize=False)),
        "qat-w": Recipe("qat-w", w=rne),
        "w8a8": Recipe("w8a8", x=fp8, w=fp8),  # FP8 rollouts: 1x128 activations, 128 weights
        "w4a4": w4a4,
        "w4a4-rc": w4a4.with_(name="w4a4-rc", compensation=ResidualCompensation()),
    }


PRESETS: dict[str, Recipe] = _presets()

# "PRESET@SCOPE" keeps one part of the preset's linear quantization and runs the rest of every
# linear GEMM on unquantized operands; attention and optimizer states stay as they are. It
# ablates which operands of the linears cost the loss. The wgrad pair moves together because a
# Hadamard transform on one of them cancels only against the other.
SCOPES: dict[str, tuple[str, ...]] = {
    "forward": ("x", "w"),  # fprop; dgrad and wgrad in high precision
    "backward": ("dy", "w_dgrad", "x_wgrad", "dy_wgrad"),  # dgrad and wgrad; fprop exact
    "weights": ("w", "w_dgrad"),  # W wherever it is multiplied (fprop, dgrad)
}


def scoped(r: Recipe, scope: str) -> Recipe:
    """`r` with only the linear operands of `scope` (a SCOPES key) quantized."""
    if scope not in SCOPES:
        raise ValueError(f"recipe scope {scope!r} is unknown; choose one of {list(SCOPES)}")
    keep = SCOPES[scope]
    ops = {name: getattr(r, name) for name in _LINEAR_OPERANDS}
    # A backward operand of None reuses the forward's quantized tensor; when the forward
    # operand is dropped, the backward quantizes the master tensor the same way instead.
    for backward, forward in (("w_dgrad", "w"), ("x_wgrad", "x")):
        if ops[backward] is None and forward not in keep:
            ops[backward] = ops[forward]
    ops = {name: spec if name in keep else QuantSpec.none() for name, spec in ops.items()}
    w_kept = ops["w"].format != "none"
    return r.with_(name=f"{r.name}@{scope}", **ops,
                   lowrank=r.lowrank if w_kept else None,  # it fits W - Q(W): zero here
                   compensation=r.compensation if ops["x"].format != "none" else None,
                   weight_storage=r.weight_storage if w_kept else "master")


def recipe(name: str | Recipe | Mapping[str, Any]) -> Recipe:
    """A Recipe as it is, a mapping (a preset with fields changed: `recipe_mapping`), or a named
    preset: bf16, fp8, nvfp4, nvfp4-nvidia, lowrank, lowrank-nvidia, fullstack (and
    its attention ablations fullstack-noreuse, fullstack-ds-hp), fullstack-nvidia (and
    fullstack-nvidia-noreuse, -reuse-v, -reuse-qk, -reblock, -tiles, -rotated,
    -rotated-noreuse, -fresh-sr, -noreuse-sr, -sr-qkv, -sr-qkv-noreuse, -noreuse-delta,
    -noreuse-lora, -noreuse-4over6, -noreuse-w1x16, -noreuse-w1x16-4over6, -noreuse-last-bf16,
    -hp-backward), qat-w, w8a8, w4a4, w4a4-rc.
    "-nvidia" below fullstack: NVIDIA's linear quantizers on every block (nvfp4-nvidia's, none
    in BF16 but in -last-bf16). "PRESET@SCOPE" quantizes only the SCOPE part of the preset's
    linears (forward, backward or weights; `scoped`)."""
    if isinstance(name, Recipe):
        return name
    if isinstance(name, Mapping):
        from .recipe_mapping import recipe_from_mapping  # it builds on this module

        return recipe_from_mapping(name)
    if not isinstance(name, str):
        raise ValueError(f"a recipe is a preset name, a mapping or a Recipe, got {name!r}")
    base, at, scope = name.partition("@")
    if base not in PRESETS:
        raise ValueError(f"unknown recipe {base!r}; the presets are {sorted(PRESETS)}, each "
                         f"optionally with @SCOPE ({', '.join(SCOPES)}), or build a Recipe from "
                         "QuantSpecs")
    return scoped(PRESETS[base], scope) if at else PRESETS[base]
