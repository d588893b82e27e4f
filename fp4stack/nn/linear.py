"""QuantLinear: a linear layer whose three GEMMs quantize their operands as a Recipe says.

On hardware without FP4 tensor cores the GEMMs are emulated: each operand is quantized and
dequantized (bit-exact NVFP4 values) and multiplied in the input's dtype. Operands the backward
needs are quantized once, in the forward, from the unquantized tensors, and saved; the backward
never re-quantizes a quantized tensor. A packed layer's inference on CUDA (no gradient wanted)
is one fused kernel instead (`nn.inference_linear`): the weight is dequantized in registers
from its packed bytes, to the same values, and nothing syncs with the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..api import dequantize, quantize
from ..formats.fp8 import FP8Tensor
from ..formats.spec import QuantSpec
from ..formats.tensor import NVFP4Tensor
from ..kernels.fp8_gemm import fp8_linear, fp8_weight
from ..ops import spec_key
from . import compensation as rc
from .fused import shared_amax
from .inference_linear import native_fp8_ok, quantized_inference_linear
from .lowrank import count_and_refresh, fit_factors
from .lowrank_split import lowrank_product, split_weight
from .operands import (
    _compute_dtype,
    common_amax,
    fused_inference_ok,
    quantize_operand,
    quantize_operand_pair,
    weight_operand,
)
from .packed import PackedSlot, PackedState
from .recipe import Recipe
from .recipe import recipe as get_recipe


class _QuantLinearFn(torch.autograd.Function):
    """y = Q(x) Q(W)ᵀ + b; dx = Q(dy) Q(W); dW = Q(dyᵀ) Q(xᵀ)ᵀ, each Q from the recipe.

    Operands are quantized in their own dtype (the fp32 master weight, not a bf16 copy of it) and
    then cast to the compute dtype, which is also what the backward's operands are saved in.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, packed_w, recipe: Recipe, x_amax, w_amax, dgrad_w):
        dtype = _compute_dtype(x)
        # Quantized in their own dtype, rounded once to the compute dtype inside the kernel.
        qw = (packed_w.to(dtype) if packed_w is not None
              else weight_operand(weight, recipe.w, w_amax, dtype=dtype))
        weight_grad = weight is not None and ctx.needs_input_grad[1]
        x_wgrad = weight_grad and recipe.x_wgrad is not None
        shared = common_amax(x, recipe.x, recipe.x_wgrad) if x_wgrad and x_amax is None else None
        x_amax = x_amax if shared is None else shared
        # Q(x) and its column-wise copy from one read of x; not when the weight's dgrad operand
        # draws random numbers, which it does between the two (the random stream stays put).
        paired = x_wgrad and not (recipe.w_dgrad and recipe.w_dgrad.rounding == "stochastic")
        if paired:
            qx, xw = quantize_operand_pair(x, recipe.x, recipe.x_wgrad, x_amax, shared, dtype)
        else:
            qx = quantize_operand(x, recipe.x, x_amax, dtype=dtype)
        y = qx @ qw.t()
        if bias is not None:
            y = y + bias.to(dtype)
        if recipe.w_dgrad is None:
            wd = qw
        elif dgrad_w is not None:
            wd = dgrad_w.to(dtype)
        else:
            wd = weight_operand(weight, recipe.w_dgrad, columnwise=True, dtype=dtype)
        if not paired:
            xw = None
            if weight_grad:
                xw = qx if recipe.x_wgrad is None else quantize_operand(
                    x, recipe.x_wgrad, shared, columnwise=True, dtype=dtype)
        ctx.recipe, ctx.has_bias, ctx.weight_grad = recipe, bias is not None, weight_grad
        ctx.save_for_backward(wd, xw)
        return y

    @staticmethod
    def backward(ctx, dy):
        wd, xw = ctx.saved_tensors
        recipe = ctx.recipe
        shared = common_amax(dy, recipe.dy, recipe.dy_wgrad) if ctx.weight_grad else None
        dw = None
        if ctx.weight_grad:
            qdy, dyw = quantize_operand_pair(dy, recipe.dy, recipe.dy_wgrad, shared, shared)
            dx = qdy @ wd
            dw = dyw.t() @ xw
        else:
            dx = quantize_operand(dy, recipe.dy, shared) @ wd
        db = dy.sum(0) if ctx.has_bias else None
        return dx, dw, db, None, None, None, None, None


def quant_linear(x2: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 recipe: Recipe, *, packed: torch.Tensor | None = None, x_amax=None, w_amax=None,
                 rc_channels: torch.Tensor | None = None, calibration: dict | None = None,
                 dgrad: torch.Tensor | None = None):
    """y = x2 Wᵀ + b for x2 [T, K] with the GEMMs of `recipe`. `packed`: the forward operand's
    values already quantized: the dequantized weight of an inference layer (then `weight` is
    None), or FSDP2's NVFP4 all-gather's (`weight` is then the parameter that holds them and
    takes the gradient), with `dgrad` the backward's column-wise operand where the recipe has
    one."""
    if recipe.compensation is not None:
        return _compensated(x2, weight, bias, recipe, packed, x_amax, w_amax, rc_channels,
                            calibration)
    if recipe.quantizes or packed is not None:
        return _QuantLinearFn.apply(x2, weight, bias, packed, recipe, x_amax, w_amax, dgrad)
    return F.linear(x2, weight, bias)


def _compensated(x2, weight, bias, recipe, packed, x_amax, w_amax, rc_channels, calibration):
    # The rollout's forward: Q(x) Q(W)ᵀ plus the correction of the chosen channels.
    qw = packed if packed is not None else quantize_operand(weight, recipe.w, w_amax)
    qx = quantize_operand(x2, recipe.x, x_amax)
    residual = x2 - qx
    if calibration is not None:
        calibration["energy"] += rc.channel_energy(residual.detach().float(),
                                                   qw.detach().float()).cpu()
    cfg = recipe.compensation
    channels = rc_channels if cfg.mode == "static" else None
    if channels is None:
        channels = rc.top_channels(residual, qw, cfg.count(x2.shape[-1]))
    y = qx @ qw.t() + rc.correction(residual, qw, channels)
    return y + bias if bias is not None else y


class QuantLinear(PackedState, nn.Module):
    """Drop-in for nn.Linear whose GEMMs follow a Recipe.

    weight_storage="master": the weight is a trainable Parameter, quantized on every forward (the
    trainer's view). "packed": it is held as the packed NVFP4Tensor "weight" (buffers weight_data,
    weight_scales, weight_global_amax; see `PackedState`) and dequantized on the fly (the
    rollout's view); `pack()` converts. `weight_amax` imposes a global amax shared with sibling
    layers (fused q/k/v, gate/up). A low-rank branch refreshed every n training forwards counts
    them in `lowrank_forwards`, saved with the weights (a CPU tensor, see `_setup`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 recipe: Recipe | str = "nvfp4", device=None, dtype=None) -> None:
        super().__init__()
        linear = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)
        self._setup(linear.weight, linear.bias, get_recipe(recipe))

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe | str) -> QuantLinear:
        """A QuantLinear sharing `linear`'s parameters; packed at once for "packed" recipes."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"QuantLinear.from_linear takes an nn.Linear, got "
                            f"{type(linear).__name__}; quantize_model converts a whole model "
                            "and leaves other layers as they are")
        q = cls.__new__(cls)
        nn.Module.__init__(q)
        q._setup(linear.weight, linear.bias, get_recipe(recipe))
        if q.recipe.weight_storage == "packed":
            q.pack()
        return q

    def _setup(self, weight: nn.Parameter, bias: nn.Parameter | None, recipe: Recipe) -> None:
        self.out_features, self.in_features = weight.shape
        self.recipe = recipe
        self.weight, self.bias = weight, bias
        self.register_buffer("weight_amax", None)
        self.amax_group: list[QuantLinear] | None = None  # siblings sharing one global amax
        self.register_buffer("x_amax", None)  # calibrated static activation amax
        self.register_buffer("rc_channels", None)  # calibrated compensation channels
        self._calibration: dict | None = None
        # Under FSDP2 with NVFP4 all-gathers (train/fsdp_nvfp4.py): the gather's plan, and the
        # column-wise dgrad operand its last gather delivered; the weight then holds Q(W).
        self.nvfp4_gather = None
        self.gathered_dgrad: NVFP4Tensor | None = None
        if recipe.lowrank is not None:
            a, b = fit_factors(weight, recipe.w, recipe.lowrank.rank, recipe.lowrank.fit)
            if recipe.lowrank.trainable:
                self.lowrank_a, self.lowrank_b = nn.Parameter(a), nn.Parameter(b)
            else:
                self.register_buffer("lowrank_a", a)
                self.register_buffer("lowrank_b", b)
            if _refreshes(recipe):
                # A CPU tensor and not a buffer: deciding a refresh reads it on the host with no
                # device sync (also inside a compiled graph, where the op below reads it), and
                # it stays out of .to() and of DDP's buffer broadcasts. The state dict holds it.
                self.lowrank_forwards = torch.zeros((), dtype=torch.int64)

    # ---- weights -------------------------------------------------------------------------
    def shared_weight_amax(self) -> torch.Tensor | None:
        """The global amax this layer's weight is quantized with, when it is imposed: the max over
        its amax group's current master weights (fused q/k/v, gate/up), else `weight_amax`."""
        if self.amax_group is not None and self.weight is not None:
            return shared_amax(m.weight for m in self.amax_group if m.weight is not None)
        return self.weight_amax

    @torch.no_grad()
    def pack(self) -> None:
        """Replace the master weight by its packed NVFP4 form (inference); frees the master."""
        if self.weight is None:
            return
        if _splits(self.recipe):
            raise ValueError(f"{self.recipe.name}: a layer that splits W (LowRank fit='weight') "
                             "computes W - L from its master weight: it cannot be packed")
        t = quantize(self.weight.detach(), spec=self.recipe.w, amax=self.shared_weight_amax())
        self.register_packed(PackedSlot("weight", master="weight", shape=t.shape, spec=t.spec),
                             [t])
        del self.weight
        self.weight = None

    @property
    def packed_weight(self) -> NVFP4Tensor | None:
        """The NVFP4Tensor of a packed layer (None while it holds a master weight)."""
        return self.read_packed("weight") if self.weight is None else None

    @property
    def packed_spec(self) -> QuantSpec | None:
        """The spec of the packed weight (None while the layer holds a master weight)."""
        slot = self.packed_slots().get("weight")
        return slot.spec if slot is not None else None

    def quantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Q(W): the exact values the forward multiplies by."""
        if self.weight is None:
            return dequantize(self.packed_weight, dtype or torch.float32)
        if self.nvfp4_gather is not None and not hasattr(self.weight, "to_local"):
            # gathered: Q(W) itself, copied (FSDP2 frees the gathered storage on resharding)
            return self.weight.detach().to(dtype or self.weight.dtype, copy=True)
        qw = quantize_operand(self.weight.detach(), self.recipe.w, self.shared_weight_amax())
        return qw.to(dtype or self.weight.dtype)

    @torch.no_grad()
    def refresh_lowrank(self) -> None:
        """Recompute the low-rank factors from the current W - Q(W) (fit="weight": from W)."""
        lr = self.recipe.lowrank
        # under FSDP2's NVFP4 all-gather the layer holds Q(W): W comes from the ranks' rows
        w = self.weight if self.nvfp4_gather is None else self.nvfp4_gather.full_weight()
        a, b = fit_factors(w, self.recipe.w, lr.rank, lr.fit)
        self.lowrank_a.copy_(a)
        self.lowrank_b.copy_(b)

    # ---- forward -------------------------------------------------------------------------
    def qweight_column_sq_norms(self, dtype: torch.dtype) -> torch.Tensor:
        """float32 [K]: ||Q(W)[:, c]||² of the packed weight read in `dtype`, for residual
        compensation's channel energy (`PackedState.packed_column_norms`, cached)."""
        return self.packed_column_norms("weight", dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recipe = self.recipe
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if _splits(recipe):
            return self._split_forward(x2).reshape(*lead, self.out_features)
        if (self.weight is None and self._calibration is None
                and fused_inference_ok(x, self)):
            y = quantized_inference_linear(x2, self)
        elif native_fp8_ok(x, self):
            y = fp8_linear(x2, self.fp8_weight(), self.bias)
        else:
            y = self._reference_forward(x2)
        if recipe.lowrank is not None:
            # Refresh before use: an in-place refresh after it would modify factors this
            # forward saved for its backward (autograd's "modified by an inplace operation").
            self._maybe_refresh()
            a, b = self.lowrank_a.to(x.dtype), self.lowrank_b.to(x.dtype)
            y = y + (x2 @ a.t()) @ b.t()
        return y.reshape(*lead, self.out_features)

    @torch.no_grad()
    def fp8_weight(self) -> FP8Tensor:
        """The master weight as the w8a8 GEMM's FP8 operand, cached; re-quantized in place when
        the weight changed (its version counter), so a captured CUDA graph keeps reading it."""
        key = (self.weight.data_ptr(), self.weight._version)
        cached = getattr(self, "_fp8_cache", None)
        if cached is None or cached[0] != key:
            q = fp8_weight(self.weight)
            if cached is not None and cached[1].data.shape == q.data.shape:
                cached[1].data.copy_(q.data)
                cached[1].scale.copy_(q.scale)
                q = cached[1]
            self._fp8_cache = (key, q)
        return self._fp8_cache[1]

    def refresh_inference_cache(self) -> None:
        """Bring cached inference operands up to date with the weights (called by rollout
        engines after a weight sync, since a CUDA-graph replay never runs forward)."""
        if getattr(self, "_fp8_cache", None) is not None:
            self.fp8_weight()
        self.refresh_column_norms()

    def _split_forward(self, x2: torch.Tensor) -> torch.Tensor:
        # SVDQuant's split (lowrank_split.py): y = x Lᵀ + Q(x) Q(W - L)ᵀ, refitted before use
        # as the branch is. The residual is quantized with its own global amax: siblings of
        # an amax group share W's scale for packing, which a split layer never is.
        self._maybe_refresh()
        core, residual = split_weight(self.weight, self.lowrank_a, self.lowrank_b)
        y = self._reference_forward(x2, residual)
        return y + lowrank_product(x2, self.lowrank_a, core, self.lowrank_b)

    def _reference_forward(self, x2: torch.Tensor,
                           residual: torch.Tensor | None = None) -> torch.Tensor:
        # Training, calibration and CPU: the packed weight dequantized, then quant_linear;
        # `residual` (a split layer's W - L) in the master weight's place.
        recipe = self.recipe
        x_amax = self.x_amax if recipe.activation_amax == "static" else None
        if self.nvfp4_gather is not None:
            return self._gathered_forward(x2, x_amax)
        packed = dequantize(self.packed_weight, x2.dtype) if self.weight is None else None
        if self._calibration is not None:
            self._calibration["amax"] = torch.maximum(self._calibration["amax"],
                                                      x2.detach().abs().amax().float().cpu())
        weight, w_amax = (self.weight, self.shared_weight_amax()) if residual is None else \
            (residual, None)
        return quant_linear(x2, weight, self.bias, recipe, packed=packed, x_amax=x_amax,
                            w_amax=w_amax, rc_channels=self.rc_channels,
                            calibration=self._calibration)

    def _gathered_forward(self, x2: torch.Tensor, x_amax: torch.Tensor | None) -> torch.Tensor:
        # FSDP2 all-gathered the weight as NVFP4: it holds Q(W) (its gradient is W's, as the
        # straight-through quantizer's is), and the column-wise dgrad operand came with it.
        plan = self.nvfp4_gather
        if hasattr(self.weight, "to_local"):
            raise RuntimeError(f"{plan.name}: forward with the weight still sharded; NVFP4 "
                               "all-gathers run under FSDP2 (fully_shard)")
        if not plan.matches(self.recipe):  # switched to high precision: W itself, gathered
            if self.recipe.quantizes or (torch.is_grad_enabled() and self.weight.requires_grad):
                raise RuntimeError(f"{plan.name}: its recipe changed from what the NVFP4 "
                                   "all-gather quantizes; only a high-precision evaluation "
                                   "(no gradient) may compute with W: train with "
                                   "fsdp_gather: fp32")
            return F.linear(x2, plan.full_weight(), self.bias)
        dgrad = None
        if self.recipe.w_dgrad is not None:
            if self.gathered_dgrad is None:
                raise RuntimeError(f"{plan.name}: no column-wise operand from the all-gather")
            dgrad = dequantize(self.gathered_dgrad, _compute_dtype(x2)).t()
        # Q(W) passed apart from the parameter, detached: torch.compile traces no
        # autograd.Function given one tensor twice
        return quant_linear(x2, self.weight, self.bias, self.recipe,
                            packed=self.weight.detach(), x_amax=x_amax, dgrad=dgrad)

    def _maybe_refresh(self) -> None:
        if not (self.training and _refreshes(self.recipe)):
            return
        every = self.recipe.lowrank.refresh_every
        if torch.compiler.is_compiling():
            # One op counts and refits, so the compiled forward has no graph break here.
            plan = self.nvfp4_gather
            weight, shards, key = ((self.weight.detach(), 1, 0) if plan is None
                                   else (plan.rows, plan.shards, plan.key))
            count_and_refresh(self.lowrank_forwards, self.lowrank_a, self.lowrank_b, weight,
                              every, spec_key(self.recipe.w), self.recipe.lowrank.fit,
                              shards, key)
            return
        n = int(self.lowrank_forwards) + 1  # on the CPU: no device sync
        self.lowrank_forwards.fill_(n)
        if n % every == 0:
            self.refresh_lowrank()

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        count = vars(self).get("lowrank_forwards")
        if count is not None:
            destination[prefix + "lowrank_forwards"] = count if keep_vars else count.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        key = prefix + "lowrank_forwards"
        count = vars(self).get("lowrank_forwards")
        if count is not None and key in state_dict:
            count.copy_(state_dict[key])
            if key in unexpected_keys:
                unexpected_keys.remove(key)
        # A state saved before the counter was module state has none: not an error; the layer
        # keeps its own count (0 in a fresh one).

    # ---- calibration ---------------------------------------------------------------------
    def start_calibration(self) -> None:
        """Record activation amax and residual energy over the following forwards."""
        self._calibration = {"amax": torch.zeros(()), "energy": torch.zeros(self.in_features)}

    def finish_calibration(self) -> None:
        """Fix the static activation amax and (static mode) the compensation channels."""
        if self._calibration is None:
            raise RuntimeError("finish_calibration() called without start_calibration()")
        dev = (self.weight if self.weight is not None else self.packed_weight).device
        self.x_amax = self._calibration["amax"].to(dev)
        if self.recipe.compensation is not None:
            k = self.recipe.compensation.count(self.in_features)
            energy = self._calibration["energy"]
            self.rc_channels = rc.top_indices(energy, k).to(dev)
        self._calibration = None

    def extra_repr(self) -> str:
        packed = ", packed" if self.weight is None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, recipe={self.recipe.name}{packed}")


def _splits(recipe: Recipe) -> bool:
    # SVDQuant's split of W (LowRank fit="weight") instead of a branch added to Q(x) Q(W)ᵀ.
    return recipe.lowrank is not None and recipe.lowrank.fit == "weight"


def _refreshes(recipe: Recipe) -> bool:
    # A low-rank branch refitted from W - Q(W) every `refresh_every` training forwards.
    lr = recipe.lowrank
    return lr is not None and not lr.trainable and lr.refresh_every > 0
