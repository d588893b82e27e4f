"""Error attribution of W4A4 inference: does weight or activation quantization dominate, per layer?

QUADS (docs METHODS.md, A) claims that in NVFP4 W4A4 inference the activation error, not the
weight error, dominates, and that activation residual compensation on a few channels C,

    y_c = Q(x) Q(W)ᵀ + (x - Q(x))[:, C] Q(W)[:, C]ᵀ,

closes most of the gap to the trainer's weight-only forward t = x Q(W)ᵀ. This module measures
both claims on a real forward pass. Forward hooks on every linear layer (and on fused MoE experts)
of an unquantized model capture each GEMM's input x [T, K] and weight W [N, K]; against the exact
output y = x Wᵀ it reports, as relative Frobenius errors ||y_hat - y|| / ||y||:

    weight-only  x Q(W)ᵀ          (= the trainer target t)
    act-only     Q(x) Wᵀ
    both         Q(x) Q(W)ᵀ       (naive W4A4 rollout)
    compensated  y_c for each fraction k of channels, against y and against t, and the fraction
                 of the W4A4-vs-trainer gap ||Q(x)Q(W)ᵀ - t|| it removes.

C is picked per layer from this batch's residual energy (`nn.compensation.top_channels`, the
dynamic mode), so the compensated numbers are what the dynamic mode would get on this batch.
Quantization is the library's bit-exact fake_quantize (in float32); the GEMMs and norms run in
float64 so the float error of the measurement is far below the quantization error measured.
Layers the recipes keep in high precision (LM head, embeddings, MoE routers) are listed as
skipped, with the reason. Bias is left out: it adds the same vector to every output compared.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..api import fake_quantize
from ..formats.spec import QuantSpec
from ..nn.compensation import top_channels
from ..nn.linear import QuantLinear
from ..nn.recipe import Recipe, ResidualCompensation
from ..nn.recipe import recipe as get_recipe

DEFAULT_KS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.25)
# Matched as substrings of ".<module name>.", so "gate." catches an MoE router called "mlp.gate"
# (and "shared_expert_gate") but not "gate_proj".
DEFAULT_SKIP: tuple[str, ...] = ("lm_head", "embed", "router", "gate.")
_SKIP_REASONS = {
    "lm_head": "LM head: kept in high precision by the recipes",
    "embed": "embedding: kept in high precision by the recipes",
    "router": "MoE router: kept in high precision (router flips are a separate mismatch)",
    "gate.": "MoE router/gate: kept in high precision (router flips are a separate mismatch)",
}


# ------------------------------------------------------------------------------------ rows


@dataclass(frozen=True)
class Compensated:
    """Activation residual compensation of a fraction k of the input channels."""

    k: float  # fraction of input channels corrected
    channels: int  # how many channels that is (per expert for fused experts)
    vs_exact: float  # ||y_c - y|| / ||y||
    vs_trainer: float  # ||y_c - t|| / ||t||, t = x Q(W)ᵀ
    gap_removed: float  # 1 - ||y_c - t|| / ||Q(x)Q(W)ᵀ - t|| (1 when there is no gap)


@dataclass(frozen=True)
class LayerError:
    """One layer's errors; a skipped layer has `skipped` set and no errors.

    For fused MoE experts there is one row per projection (gate_up_proj, down_proj): each expert
    is measured on its own tokens with its own quantized weight, and the squared errors are summed
    over experts before the ratio is taken.
    """

    name: str
    kind: str  # "linear", "experts" or "skipped"
    in_features: int | None = None
    out_features: int | None = None
    tokens: int = 0  # rows of x measured (summed over experts)
    weight_only: float = math.nan
    act_only: float = math.nan
    both: float = math.nan
    gap: float = math.nan  # ||Q(x)Q(W)ᵀ - t|| / ||t||: naive W4A4 against the trainer
    compensated: tuple[Compensated, ...] = ()
    experts: int | None = None  # experts that received tokens (fused experts only)
    skipped: str | None = None

    @property
    def analysed(self) -> bool:
        return self.skipped is None

    @property
    def layer_type(self) -> str:
        """What the layer is, without its block: "q_proj", "experts.down_proj", ..."""
        parts = self.name.split(".")
        return ".".join(parts[-2:]) if self.kind == "experts" else parts[-1]

    @property
    def act_weight_ratio(self) -> float:
        return self.act_only / self.weight_only if self.weight_only > 0 else math.nan

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layer_type"] = self.layer_type
        d["act_weight_ratio"] = self.act_weight_ratio
        return nan_to_none(d)


def nan_to_none(v):
    """NaN/inf -> None, recursively, so json.dumps writes valid JSON."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: nan_to_none(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [nan_to_none(x) for x in v]
    return v


# ----------------------------------------------------------------------------- measuring


@dataclass
class _Sums:
    """Squared Frobenius norms summed over the GEMMs of one row (several calls, or experts)."""

    ks: tuple[float, ...]
    in_features: int = 0
    out_features: int = 0
    tokens: int = 0
    experts: set = field(default_factory=set)
    channels: list = field(default_factory=list)
    y: float = 0.0  # ||y||²
    t: float = 0.0  # ||t||²
    weight: float = 0.0  # ||t - y||²
    act: float = 0.0  # ||Q(x)Wᵀ - y||²
    both: float = 0.0  # ||Q(x)Q(W)ᵀ - y||²
    gap: float = 0.0  # ||Q(x)Q(W)ᵀ - t||²
    comp_exact: list = field(default_factory=list)  # per k: ||y_c - y||²
    comp_trainer: list = field(default_factory=list)  # per k: ||y_c - t||²

    def add(self, x: torch.Tensor, w: torch.Tensor, x_spec: QuantSpec, w_spec: QuantSpec) -> None:
        """Measure y = x Wᵀ for x [T, K], w [N, K] and add its squared errors."""
        n_out, k_in = w.shape
        x32, w32 = x.detach().reshape(-1, k_in).float(), w.detach().float()
        qx = fake_quantize(x32, spec=x_spec, name="layer input").double()
        qw = fake_quantize(w32, spec=w_spec, name="layer weight").double()
        x64, w64 = x32.double(), w32.double()
        y, t = x64 @ w64.t(), x64 @ qw.t()
        naive = qx @ qw.t()
        residual = x64 - qx

        sq = _sq_norm
        self.y += sq(y)
        self.t += sq(t)
        self.weight += sq(t - y)
        self.act += sq(qx @ w64.t() - y)
        self.both += sq(naive - y)
        self.gap += sq(naive - t)
        if not self.comp_exact:
            self.comp_exact, self.comp_trainer = [0.0] * len(self.ks), [0.0] * len(self.ks)
            self.channels = [ResidualCompensation(k=k).count(k_in) for k in self.ks]
        for i, n in enumerate(self.channels):
            c = top_channels(residual, qw, n)
            compensated = naive + residual[:, c] @ qw[:, c].t()
            self.comp_exact[i] += sq(compensated - y)
            self.comp_trainer[i] += sq(compensated - t)
        self.in_features, self.out_features = k_in, n_out
        self.tokens += x32.shape[0]

    def row(self, name: str, kind: str) -> LayerError:
        comp = tuple(
            Compensated(k, n, _ratio(ce, self.y), _ratio(ct, self.t), 1.0 - _ratio(ct, self.gap))
            for k, n, ce, ct in zip(
                self.ks, self.channels, self.comp_exact, self.comp_trainer, strict=True
            )
        )
        return LayerError(
            name, kind, self.in_features, self.out_features, self.tokens,
            weight_only=_ratio(self.weight, self.y), act_only=_ratio(self.act, self.y),
            both=_ratio(self.both, self.y), gap=_ratio(self.gap, self.t), compensated=comp,
            experts=len(self.experts) if kind == "experts" else None,
        )


def _sq_norm(t: torch.Tensor) -> float:
    return float(t.square().sum())


def _ratio(num_sq: float, den_sq: float) -> float:
    """sqrt(num / den) for squared norms: 0 for 0 / 0, NaN for x / 0."""
    if den_sq == 0.0:
        return 0.0 if num_sq == 0.0 else math.nan
    return math.sqrt(num_sq / den_sq)


def layer_errors(
    x: torch.Tensor, weight: torch.Tensor, recipe: Recipe | str = "w4a4",
    ks: Sequence[float] = DEFAULT_KS, name: str = "layer",
) -> LayerError:
    """The errors of one GEMM y = x Wᵀ (x [..., K], weight [N, K]) under a recipe's x and w."""
    rec, ks = _check(recipe, ks)
    sums = _Sums(ks)
    sums.add(x, weight, rec.x, rec.w)
    return sums.row(name, "linear")


# ------------------------------------------------------------------------------ the model


def _skip_reason(name: str, skip: Sequence[str]) -> str | None:
    dotted = f".{name}."
    for pattern in skip:
        if pattern in dotted:
            return _SKIP_REASONS.get(pattern, f"name matches skip pattern {pattern!r}")
    return None


def _is_fused_experts(m: nn.Module) -> bool:
    """transformers 5.x fused experts (Qwen3-MoE, OLMoE, Mixtral, ...) and fp4stack.nn.moe.Experts:
    3D `gate_up_proj` [E, 2I, D] and `down_proj` [E, D, I] parameters."""
    gu, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return all(isinstance(p, torch.Tensor) and p.dim() == 3 for p in (gu, down))


def _weight_dims(m: nn.Module) -> list[int]:
    return [p.dim() for p in m.parameters(recurse=False)]


def _find_targets(
    model: nn.Module, skip: Sequence[str]
) -> tuple[dict[str, tuple[nn.Module, str]], list[LayerError]]:
    """{name: (module, "linear" | "experts")} to hook, and rows for the weight-bearing modules
    left out (with the reason)."""
    targets: dict[str, tuple[nn.Module, str]] = {}
    skipped: list[LayerError] = []

    def leave_out(name: str, reason: str) -> None:
        skipped.append(LayerError(name, "skipped", skipped=reason))

    for name, m in model.named_modules():
        reason = _skip_reason(name, skip)
        if isinstance(m, (nn.Linear, QuantLinear)):
            if reason:
                leave_out(name, reason)
            elif m.weight is None:
                leave_out(name, "packed weight: no unquantized master copy to compare with")
            else:
                targets[name] = (m, "linear")
        elif _is_fused_experts(m):
            if reason:
                leave_out(name, reason)
            else:
                targets[name] = (m, "experts")
        elif any(d >= 2 for d in _weight_dims(m)):  # embeddings, routers, unknown expert layouts
            if reason is None:
                layout = "3D weights" if 3 in _weight_dims(m) else "weights"
                reason = f"not analysed: {type(m).__name__} with {layout} is not a known linear"
            leave_out(name, reason)
    return targets, skipped


def _first_input(args: tuple, kwargs: dict) -> torch.Tensor:
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v
    raise RuntimeError("hooked module was called without a floating-point input")


def _routing_indices(args: tuple, kwargs: dict) -> torch.Tensor:
    # HF passes (hidden_states, top_k_index, top_k_weights), fp4stack (x, weights, indices):
    # the [T, k] integer tensor is the routing either way.
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor) and not v.is_floating_point():
            return v
    raise RuntimeError("fused experts were called without integer routing indices")


def _expert_weights(m: nn.Module, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [2I, D], down [D, I]) of expert e, in [out, in] layout."""
    gu, down = m.gate_up_proj[e], m.down_proj[e]
    if getattr(m, "is_transposed", False):  # e.g. GPT-OSS stores [E, D, 2I]
        gu, down = gu.t(), down.t()
    return gu, down


def _gated(m: nn.Module, gate_up_out: torch.Tensor) -> torch.Tensor:
    """The down projection's input from the gate_up output, as the module computes it."""
    if hasattr(m, "_apply_gate"):  # transformers' hook for each model's gating
        return m._apply_gate(gate_up_out)
    gate, up = gate_up_out.chunk(2, dim=-1)
    return getattr(m, "act_fn", F.silu)(gate) * up


def _measure_experts(m: nn.Module, x: torch.Tensor, indices: torch.Tensor,
                     gate_up: _Sums, down: _Sums, rec: Recipe) -> None:
    x = x.reshape(-1, x.shape[-1])
    indices = indices.reshape(x.shape[0], -1)
    bias = getattr(m, "gate_up_proj_bias", None)
    for e in range(m.gate_up_proj.shape[0]):
        tokens = (indices == e).any(dim=-1).nonzero().squeeze(-1)
        if tokens.numel() == 0:
            continue
        w_gu, w_down = _expert_weights(m, e)
        xe = x[tokens]
        gate_up.add(xe, w_gu, rec.x, rec.w)
        out = F.linear(xe, w_gu, None if bias is None else bias[e])
        down.add(_gated(m, out), w_down, rec.x, rec.w)
        gate_up.experts.add(e)
        down.experts.add(e)


def _check(recipe: Recipe | str, ks: Sequence[float]) -> tuple[Recipe, tuple[float, ...]]:
    rec = get_recipe(recipe)
    if rec.x.format == "none" or rec.w.format == "none":
        raise ValueError(f"recipe {rec.name!r} must quantize both x and w (a W4A4 recipe such as "
                         "'w4a4') to attribute the error between them")
    ks = tuple(float(k) for k in ks)
    for k in ks:
        ResidualCompensation(k=k)  # validates: a fraction in (0, 1]
    return rec, ks


def attribute_error(
    model: nn.Module,
    batch: torch.Tensor | Mapping[str, torch.Tensor],
    recipe: Recipe | str = "w4a4",
    ks: Sequence[float] = DEFAULT_KS,
    skip: Sequence[str] = DEFAULT_SKIP,
    progress: bool = False,
) -> list[LayerError]:
    """Run `batch` through the unquantized `model` once and attribute each layer's W4A4 error.

    batch: input ids (called as model(batch)) or a mapping of keyword arguments (model(**batch)).
    ks: fractions of input channels for residual compensation, each in (0, 1].
    skip: substrings of ".<module name>." that mark layers kept in high precision.
    Returns one row per analysed linear layer (two per fused-experts module), in module order,
    followed by the skipped layers with their reasons. The model itself is not modified.
    """
    rec, ks = _check(recipe, ks)
    targets, skipped = _find_targets(model, skip)
    sums: dict[str, _Sums] = {}
    bar = _progress_bar(len(targets), progress)

    def hook_for(name: str, kind: str):
        def hook(module, args, kwargs, output):
            x = _first_input(args, kwargs)
            if kind == "linear":
                sums.setdefault(name, _Sums(ks)).add(x, module.weight, rec.x, rec.w)
            else:
                gate_up = sums.setdefault(f"{name}.gate_up_proj", _Sums(ks))
                down = sums.setdefault(f"{name}.down_proj", _Sums(ks))
                _measure_experts(module, x, _routing_indices(args, kwargs), gate_up, down, rec)
            if bar is not None:
                bar.update(1)

        return hook

    handles = [m.register_forward_hook(hook_for(name, kind), with_kwargs=True)
               for name, (m, kind) in targets.items()]
    try:
        with torch.no_grad():
            model(**batch) if isinstance(batch, Mapping) else model(batch)
    finally:
        for h in handles:
            h.remove()
        if bar is not None:
            bar.close()

    rows = []
    for name, (_, kind) in targets.items():  # module order, not call order
        keys = [name] if kind == "linear" else [f"{name}.gate_up_proj", f"{name}.down_proj"]
        for key in keys:
            if key in sums:
                rows.append(sums[key].row(key, kind))
            else:
                reason = "no tokens reached it" if kind == "experts" else "not called"
                skipped.append(LayerError(key, "skipped", skipped=f"{reason} in this batch"))
    return rows + skipped


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="attributing layers", unit="layer", file=sys.stderr)
