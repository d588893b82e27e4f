"""Quantized MoE experts: stacked expert weights whose every GEMM follows a Recipe.

Each expert's weight is quantized on its own (its own global amax, as inference engines store
one global scale per expert; the fused gate/up weight of an expert shares one). Calibration
(`fp4stack.convert.calibrate`) records each expert's activation amax per projection in `x_amax`
[2, E] (row 0: the gate/up input, row 1: the down input), which a static-amax recipe uses and
the compressed-tensors export writes as input scales, and, for QUADS's static compensation, each
expert's channels per projection (`rc_channels_gate_up` [E, k], `rc_channels_down`). Two front ends
share the maths: fp4stack's `Experts` (its `expert_linear` hook) and the fused experts of
transformers 5.x (Qwen3-MoE, OLMoE, Mixtral: forward(hidden_states, top_k_index, top_k_weights)).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..api import dequantize, fake_quantize, quantize
from ..formats.tensor import NVFP4Tensor
from . import compensation as rc
from .linear import quant_linear
from .moe import Experts
from .packed import PackedSlot, PackedState
from .recipe import Recipe

_PROJS = ("gate_up", "down")


class ExpertQuantization(PackedState):
    """Mixin: `recipe`, optional packed storage, and the quantized per-expert GEMM."""

    recipe: Recipe

    def _init_quantization(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.register_buffer("x_amax", None)  # calibrated [2, E]: gate_up, down inputs
        for proj in _PROJS:  # calibrated static compensation channels [E, k] per projection
            self.register_buffer(f"rc_channels_{proj}", None)
        self._calibration: dict | None = None
        if recipe.weight_storage == "packed":
            self.pack()

    def expert_count(self) -> int:
        """E, from the master stack or the packed one."""
        w = getattr(self, "gate_up_proj", None)
        return w.shape[0] if w is not None else self.packed_slots()["gate_up"].count

    @torch.no_grad()
    def pack(self) -> None:
        """Hold every expert weight as packed NVFP4: per projection a stack with one tensor per
        expert (buffers <proj>_data, <proj>_scales, <proj>_amax; see `PackedState`)."""
        for proj in _PROJS:
            master = f"{proj}_proj"
            w = getattr(self, master)
            ts = [quantize(w[e].detach(), spec=self.recipe.w) for e in range(w.shape[0])]
            self.register_packed(PackedSlot(proj, master=master, shape=ts[0].shape,
                                            spec=ts[0].spec, amax_key="amax", count=len(ts)), ts)
            delattr(self, master)
            setattr(self, master, None)

    def packed_expert(self, proj: str, e: int) -> NVFP4Tensor:
        """Expert `e`'s packed weight of projection `proj` ("gate_up" or "down")."""
        return self.read_packed(proj, e)

    def packed_stack(self, proj: str):
        """Projection `proj`'s packed weights as one `kernels.packed_gemm.PackedExperts`."""
        from ..kernels.packed_gemm import PackedExperts

        slot = self.packed_slots()[proj]
        data, scales, amax = (getattr(self, key) for key in slot.keys)
        return PackedExperts(data, scales, amax, slot.shape[-1], slot.spec)

    def grouped_operands(self, dtype: torch.dtype | None = None) -> tuple | None:
        """(gate_up, down, x_spec, compensation) for the grouped kernels when the weights are
        packed and the recipe's activations are unquantized or NVFP4 1x16 round-to-nearest (each
        expert's rows with their own amax, as the loop); with QUADS's residual compensation,
        per projection its channel count and the experts' column norms read in `dtype` (the
        activations'), or in static mode once calibrated their channels as bool masks. None
        otherwise (master weights, FP8, stochastic rounding or 16x16 activations), which keeps
        the per-expert loop."""
        if self._calibration is not None or self._static_x_amax():
            return None  # the loop records, or applies, each expert's own activation amax
        comp = self.recipe.compensation
        if getattr(self, "gate_up_proj", None) is not None:
            return None if comp is not None else self._fp8_grouped_operands()
        from ..kernels.compensation import operand_supported
        from ..kernels.packed_gemm import rows_fake_quantize_supported

        spec = self.recipe.x
        if spec.format == "none":
            spec = None
        elif not rows_fake_quantize_supported(spec):
            return None
        compensation = None
        if comp is not None:
            ks = [self._input_features(proj) for proj in _PROJS]
            if spec is None or not all(operand_supported(spec, k) for k in ks):
                return None
            # Per projection (count, per-channel tensor): the experts' column norms [E, K]
            # (channels picked per batch), or bool keep masks [E, K] (static mode, calibrated).
            compensation = tuple(
                (comp.count(k), self.compensation_keep(f"rc_channels_{proj}", k)
                 if self._static_channels() else
                 self.packed_column_norms(proj, dtype or torch.float32))
                for proj, k in zip(_PROJS, ks, strict=True))
        return self.packed_stack("gate_up"), self.packed_stack("down"), spec, compensation

    def sorted_operands(self) -> tuple | None:
        """Master weights with the recipe's GEMMs (and calibrated static activation amax);
        None while calibrating, for compensation or packed weights (the loop serves those)."""
        if (self._calibration is not None or self.recipe.compensation is not None
                or getattr(self, "gate_up_proj", None) is None):
            return None
        x_amax = self.x_amax if self._static_x_amax() else None
        return (self.gate_up_proj, self.down_proj), self.recipe, x_amax

    def _fp8_grouped_operands(self) -> tuple | None:
        """Master weights with FP8 operands scaled per row or per 1x128 block (w8a8): each row's
        values do not depend on which rows share its expert, so the stacks are fake-quantized
        whole (cached until the weights change) and the activations row by row, as the loop."""
        specs = (self.recipe.x, self.recipe.w)
        if not all(s is not None and s.format == "fp8" and s.fp8_granularity != "tensor"
                   for s in specs):
            return None
        return self.fp8_stack("gate_up"), self.fp8_stack("down"), self.recipe.x, None

    @torch.no_grad()
    def fp8_stack(self, proj: str) -> torch.Tensor:
        """Projection `proj`'s master stack fake-quantized by the recipe's w spec, cached; when
        the weights change (version counter) recomputed into the same tensor, so a CUDA graph
        that captured it reads the new values after `refresh_inference_cache`."""
        w = getattr(self, f"{proj}_proj")
        key = (w.data_ptr(), w._version)
        cache = vars(self).setdefault("_fp8_stacks", {})
        if proj not in cache or cache[proj][0] != key:
            q = fake_quantize(w, spec=replace(self.recipe.w, nan_policy="propagate"))
            if proj in cache:
                q = cache[proj][1].copy_(q)
            cache[proj] = (key, q)
        return cache[proj][1]

    def refresh_inference_cache(self) -> None:
        """Bring cached inference operands up to date after a weight sync (rollout engines call
        it: a CUDA-graph replay never runs forward)."""
        for proj in list(vars(self).get("_fp8_stacks", {})):
            self.fp8_stack(proj)
        self.refresh_column_norms()

    def quant_expert_linear(self, x: torch.Tensor, e: int, proj: str) -> torch.Tensor:
        row = _PROJS.index(proj)
        if self._calibration is not None and x.numel():
            seen = self._calibration["amax"]
            seen[row, e] = torch.maximum(seen[row, e], x.detach().abs().amax().float().cpu())
        x_amax = self.x_amax[row, e] if self._static_x_amax() else None
        compensation = {}
        if self.recipe.compensation is not None:
            if self._calibration is not None:  # this expert's row of the energy sums
                compensation["calibration"] = {"energy": self._calibration["energy"][proj][e]}
            elif self._static_channels():
                compensation["rc_channels"] = getattr(self, f"rc_channels_{proj}")[e]
        w = getattr(self, f"{proj}_proj")
        if w is None:
            packed = dequantize(self.read_packed(proj, e), x.dtype)
            return quant_linear(x, None, None, self.recipe, packed=packed, x_amax=x_amax,
                                **compensation)
        return quant_linear(x, w[e], None, self.recipe, x_amax=x_amax, **compensation)

    def _static_x_amax(self) -> bool:
        return self.recipe.activation_amax == "static" and self.x_amax is not None

    def _static_channels(self) -> bool:
        comp = self.recipe.compensation
        return (comp is not None and comp.mode == "static"
                and self.rc_channels_gate_up is not None)

    def _input_features(self, proj: str) -> int:
        w = getattr(self, f"{proj}_proj", None)
        return w.shape[-1] if w is not None else self.packed_slots()[proj].shape[-1]

    # ---- calibration ---------------------------------------------------------------------
    def start_calibration(self) -> None:
        """Record each expert's activation amax, per projection, over the following forwards
        (and, with residual compensation, each expert's residual energy per input channel)."""
        e = self.expert_count()
        self._calibration = {"amax": torch.zeros(2, e)}
        if self.recipe.compensation is not None:
            self._calibration["energy"] = {proj: torch.zeros(e, self._input_features(proj))
                                           for proj in _PROJS}

    def finish_calibration(self) -> None:
        """Fix `x_amax`. An expert no calibration token reached takes the largest amax of its
        projection over the other experts (its input has the same distribution, and an amax of
        0 would zero its activations)."""
        if self._calibration is None:
            raise RuntimeError("finish_calibration() called without start_calibration()")
        amax = self._calibration["amax"]
        amax = torch.where(amax > 0, amax, amax.amax(dim=1, keepdim=True))
        w = getattr(self, "gate_up_proj", None)
        dev = w.device if w is not None else self.read_packed("gate_up", 0).data.device
        self.x_amax = amax.to(dev)
        comp = self.recipe.compensation
        for proj, energy in self._calibration.get("energy", {}).items():
            # Static mode's channels: each expert's top k by its own residual energy; an expert
            # no token reached takes those of the projection's energy over all experts.
            whole = energy.sum(0)
            k = comp.count(energy.shape[1])
            chosen = [rc.top_indices(row if row.any() else whole, k) for row in energy]
            setattr(self, f"rc_channels_{proj}", torch.stack(chosen).to(dev))
        self._calibration = None


class QuantExperts(ExpertQuantization, Experts):
    """fp4stack's Experts with quantized GEMMs (parameters shared with the original)."""

    @classmethod
    def from_experts(cls, experts: Experts, recipe: Recipe) -> QuantExperts:
        q = cls.__new__(cls)
        nn.Module.__init__(q)
        q.n_experts, q.dim, q.hidden = experts.n_experts, experts.dim, experts.hidden
        q.gate_up_proj, q.down_proj = experts.gate_up_proj, experts.down_proj
        q._init_quantization(recipe)
        return q

    def expert_linear(self, x: torch.Tensor, expert: int, which: str) -> torch.Tensor:
        return self.quant_expert_linear(x, expert, which)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", recipe={self.recipe.name}"


class QuantHFExperts(ExpertQuantization, nn.Module):
    """transformers 5.x fused experts (gate_up_proj [E, 2I, D], down_proj [E, D, I], act_fn)
    with quantized GEMMs; the eager loop of the original, one expert at a time."""

    def __init__(self, experts: nn.Module, recipe: Recipe) -> None:
        super().__init__()
        self.num_experts = experts.gate_up_proj.shape[0]
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
        self.act_fn = experts.act_fn
        self._init_quantization(recipe)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == e)
            gate, up = self.quant_expert_linear(hidden_states[token], e, "gate_up").chunk(2, -1)
            y = self.quant_expert_linear(self.act_fn(gate) * up, e, "down")
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, recipe={self.recipe.name}"


def is_hf_fused_experts(module: nn.Module) -> bool:
    """A transformers 5.x fused-experts module (3D gate_up_proj and down_proj, an act_fn)."""
    w = getattr(module, "gate_up_proj", None)
    d = getattr(module, "down_proj", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 3 and isinstance(d, torch.Tensor)
            and d.dim() == 3 and hasattr(module, "act_fn"))
