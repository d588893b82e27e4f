"""FSDP2 all-gathers of FP4 linear weights as NVFP4 bytes instead of fp32 rows.

FSDP2 keeps each weight sharded by rows and all-gathers it before a block's forward and
backward: 4 bytes an element for fp4stack's fp32 master weights. A QuantLinear multiplies by
Q(W), never by W, so each rank can quantize its own rows with the whole tensor's global amax and
all-gather the packed codes and E4M3 block scales instead: 0.5625 bytes an element, and as much
again where the recipe's dgrad takes its own column-wise Q(W) (3.6x and 1.8x fewer bytes than a
BF16 all-gather). A rank's rows are whole blocks (1x16 blocks lie in a row; the column-wise
operand's and 16x16 tiles' blocks span 16 rows, so shard boundaries must fall on multiples of
16), and the global amax is the max of the ranks' amaxes (one all-reduce before each forward),
so the gathered values are one process's Q(W) bit for bit, and so are the losses and gradients,
eager or compiled (the compiled graph is the fp32 all-gather's but for the weight quantizers).

How: before `fully_shard`, `enable` makes each eligible layer's weight an `NVFP4GatherWeight`,
a tensor subclass that behaves as its fp32 data everywhere (optimizers, checkpoints, clipping)
and gives FSDP2 the two hooks of its all-gather extension: `fsdp_pre_all_gather` quantizes the
local rows, `fsdp_post_all_gather` reads the gathered bytes back as the fp32 values of Q(W)
(the unsharded parameter, which receives the gradient as before) and hands the column-wise
operand to its layer. Where a recipe reads W itself (a low-rank branch's refit, a forward
switched to high precision) the layer all-gathers its fp32 rows for it (`nn.rows`). Layers that
cannot be gathered this way (SVDQuant's split, whose core sums over all of W's rows each
forward; compensated recipes, stochastically rounded weights, FP8, rows not divisible as
above, MoE experts) keep FSDP2's fp32 all-gather; `enable` says which.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ..api import dequantize, global_amax, quantize
from ..formats.spec import QuantSpec
from ..formats.tensor import NVFP4Tensor
from ..nn.linear import QuantLinear
from ..nn.rows import gather_rows, register_group
from ..optim.shard_local import local_shard

_BLOCK = 16


@dataclass
class GatherPlan:
    """What a layer's gathered weight is quantized as, and the amaxes of the current weights."""

    layer: Any  # weakref.ref to the QuantLinear
    spec: QuantSpec  # its forward operand's (recipe.w)
    dgrad_spec: QuantSpec | None  # its column-wise dgrad operand's (recipe.w_dgrad), if any
    amax: Tensor | None = None  # global amaxes, set by `refresh_amaxes` before each forward
    dgrad_amax: Tensor | None = None
    shards: int = 1
    name: str = ""
    rows: Tensor | None = None  # this rank's fp32 rows, as the last all-gather read them
    # The key of its process group in `nn.rows` (`install` registers it), one for all of a
    # model's layers: torch.compile guards on its value, and the blocks share one graph.
    key: int = 0
    stats: dict[str, int] = field(default_factory=lambda: {"gathers": 0, "bytes": 0})

    def matches(self, recipe) -> bool:
        """Whether `recipe` quantizes the weight as this plan gathers it (not after a switch to
        high precision, which computes with W itself)."""
        return recipe.w == self.spec and recipe.w_dgrad == self.dgrad_spec

    def full_weight(self) -> Tensor:
        """W itself, fp32, all-gathered from the ranks' rows (where the recipe reads W: a
        low-rank refit, the evaluation with every quantizer off)."""
        if self.rows is None:
            raise RuntimeError(f"{self.name}: no rows gathered yet")
        return gather_rows(self.rows, self.shards, self.key)


# The ops through which FSDP2 shards, pads and views a parameter: their results stay
# NVFP4GatherWeight (with the plan), so the sharded local tensor keeps the all-gather hooks.
# Every other op (optimizer maths, collectives, norms) sees and returns plain tensors.
_KEEP = {
    torch.ops.aten.detach.default, torch.ops.aten.alias.default,
    torch.ops.aten.view.default, torch.ops.aten.as_strided.default,
    torch.ops.aten.slice.Tensor, torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default, torch.ops.aten.chunk.default,
    torch.ops.aten.narrow.default, torch.ops.aten.new_zeros.default,
    torch.ops.aten.empty_like.default, torch.ops.aten.clone.default,
    torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
}


class NVFP4GatherWeight(torch.Tensor):
    """An fp32 weight (in `_data`) that FSDP2 all-gathers as NVFP4 (see the module docstring)."""

    _data: Tensor
    _plan: GatherPlan

    @staticmethod
    def __new__(cls, data: Tensor, plan: GatherPlan) -> NVFP4GatherWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, layout=data.layout, device=data.device,
            requires_grad=data.requires_grad)

    def __init__(self, data: Tensor, plan: GatherPlan) -> None:
        self._data, self._plan = data, plan

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        plans = []

        def unwrap(t: NVFP4GatherWeight) -> Tensor:
            plans.append(t._plan)
            return t._data

        args, kwargs = pytree.tree_map_only(cls, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP:
            return out
        return pytree.tree_map_only(Tensor, lambda t: cls(t, plans[0]), out)

    def __repr__(self) -> str:
        return f"NVFP4GatherWeight({self._plan.name}, {self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], self._plan

    @staticmethod
    def __tensor_unflatten__(inner, plan, outer_size, outer_stride):
        return NVFP4GatherWeight(inner["_data"], plan)

    # ---- FSDP2's all-gather extension --------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's rows as NVFP4 bytes: (codes, scales[, dgrad codes, dgrad scales])."""
        plan, rows = self._plan, self._data
        if plan.amax is None:
            raise RuntimeError(f"{plan.name}: NVFP4 all-gather before its global amax was set "
                               "(refresh_amaxes runs in the root module's forward pre-hook)")
        plan.rows = rows
        with torch.no_grad():
            t = quantize(rows, spec=plan.spec, amax=plan.amax, name=plan.name)
            inputs = [t.data, t.scales.view(torch.uint8)]
            if plan.dgrad_spec is not None:
                d = quantize(rows.t().contiguous(), spec=plan.dgrad_spec, amax=plan.dgrad_amax,
                             name=plan.name)
                inputs += [d.data, d.scales.view(torch.uint8)]
        plan.stats["gathers"] += 1
        plan.stats["bytes"] += sum(x.numel() for x in inputs)
        return tuple(x.contiguous() for x in inputs), (tuple(rows.shape),)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """The gathered bytes as the fp32 values of Q(W) (into `out` after the first gather);
        the column-wise operand goes to the layer, read by its next forward."""
        plan = self._plan
        (n, k), world = metadata[0], plan.shards
        full = (n * world, k)
        with torch.no_grad():
            codes, scales = (o.view(full[0], -1) for o in outputs[:2])
            t = NVFP4Tensor(data=codes, scales=scales.view(torch.float8_e4m3fn), amax=plan.amax,
                            shape=full, spec=plan.spec)
            values = dequantize(t, param_dtype)
            dgrad = None
            if plan.dgrad_spec is not None:  # [world, K, n/2] -> [K, N/2]: the ranks' columns
                dcodes, dscales = (o.view(world, k, -1).permute(1, 0, 2).reshape(k, -1)
                                   for o in outputs[2:])
                dgrad = NVFP4Tensor(data=dcodes, scales=dscales.view(torch.float8_e4m3fn),
                                    amax=plan.dgrad_amax, shape=(k, full[0]),
                                    spec=plan.dgrad_spec)
            layer = plan.layer()
            if layer is not None:
                layer.gathered_dgrad = dgrad
            if out is not None:
                # As FSDP2 does for its own all-gather outputs: the backward's gather rewrites
                # the forward's values unchanged, which autograd must not take for an update
                # of a tensor it saved (the forward operand is this one where no copy is made).
                with torch.autograd._unsafe_preserve_version_counter(out):
                    out.copy_(values)
                return None
        return values, (values,)


def unwrap(t: Tensor) -> Tensor:
    """The plain tensor behind `t` (its local shard's data for an NVFP4GatherWeight)."""
    return t._data if isinstance(t, NVFP4GatherWeight) else t


def ineligible(layer: QuantLinear, shards: int) -> str | None:
    """Why `layer`'s weight cannot be all-gathered in NVFP4 over `shards` ranks (None: it can)."""
    r = layer.recipe
    specs = [s for s in (r.w, r.w_dgrad) if s is not None]
    if layer.weight is None:
        return "a packed layer"
    if r.w is None or r.w.format == "none":
        return "its weight is not quantized"
    if r.w.format != "nvfp4":
        return "its weight is not NVFP4"
    if r.w_dgrad is not None and r.w_dgrad.format != "nvfp4":
        return "its dgrad weight is not NVFP4"
    if r.lowrank is not None and (r.lowrank.fit == "weight" or r.lowrank.trainable):
        # The split's core C = Bᵀ W Aᵀ sums over all of W's rows each forward; trainable
        # factors are not refitted and gather as they are, but are not a preset: not tested.
        return ("SVDQuant's split reads all of W each forward" if r.lowrank.fit == "weight"
                else "trainable low-rank factors")
    if r.compensation is not None:
        return "a compensated recipe reads W itself"
    if any(s.rounding == "stochastic" for s in specs):
        return "stochastic rounding of W draws from the run's random stream"
    n = layer.out_features
    rows = _BLOCK * shards if (r.w_dgrad is not None or r.w.block == (16, 16)) else shards
    if n % rows:
        return f"{n} rows are not a multiple of {rows} (16-row blocks on each of {shards} ranks)"
    return None


def enable(model: nn.Module, shards: int) -> dict[str, str]:
    """Make every eligible QuantLinear weight of `model` an NVFP4GatherWeight (call before
    `fully_shard`); returns {layer name: why it keeps the fp32 all-gather} for the others."""
    counts = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    left: dict[str, str] = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, QuantLinear):
            continue
        why = ineligible(layer, shards)
        if why is None and counts[id(layer.weight)] > 1:
            why = "its weight is shared with another module"
        if why is not None:
            left[name] = why
            continue
        plan = GatherPlan(weakref.ref(layer), layer.recipe.w, layer.recipe.w_dgrad,
                          shards=shards, name=f"{name}.weight")
        w = layer.weight
        layer.weight = nn.Parameter(NVFP4GatherWeight(w.data, plan), requires_grad=w.requires_grad)
        layer.nvfp4_gather = plan
    return left


def _sharded(p: Tensor) -> Tensor | None:
    """This rank's rows of a parameter FSDP2 holds sharded (a DTensor), as a plain tensor;
    None while FSDP2 has it unsharded."""
    return local_shard(p) if hasattr(p, "to_local") else None


@torch.compiler.disable  # eager, also before a compiled forward: a collective and state
@torch.no_grad()
def refresh_amaxes(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Set each gathered layer's global amaxes (its amax group's, as one process computes
    them) from the ranks' rows: one all-reduce (max) over `group` for the whole model. A NaN
    or Inf in any of those weights raises the same ValueError on every rank. Layers FSDP2
    holds unsharded keep their amaxes: they are not gathered again until resharded."""
    layers = [m for m in model.modules() if getattr(m, "nvfp4_gather", None) is not None
              and hasattr(m.weight, "to_local")]
    if not layers:
        return
    # Each layer's max |W|, and its amax group's (a group lists every sibling, itself too),
    # gathered or not; then per layer the amaxes of a Hadamard-transformed operand where its
    # spec has one.
    members = list({id(s): s for m in layers for s in (m.amax_group or [m])}.values())
    rows = {id(m): _sharded(m.weight) for m in members}
    local = [rows[id(m)].abs().amax().float() for m in members]
    extra: list[tuple[QuantLinear, str, int]] = []
    for m in layers:
        plan, w = m.nvfp4_gather, rows[id(m)]
        if plan.spec.hadamard and m.amax_group is None and m.weight_amax is None:
            extra.append((m, "amax", len(local)))
            local.append(global_amax(w, hadamard=True))
        if plan.dgrad_spec is not None and plan.dgrad_spec.hadamard:
            extra.append((m, "dgrad_amax", len(local)))
            local.append(global_amax(w.t().contiguous(), hadamard=True))
    amaxes = torch.stack(local)
    # max over ranks; NaN becomes Inf first, as a max of NaNs is not defined across backends
    amaxes = torch.where(torch.isnan(amaxes), torch.full_like(amaxes, float("inf")), amaxes)
    dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
    if not torch.isfinite(amaxes).all():
        names = {id(m): name for name, m in model.named_modules()}
        bad = [names.get(id(m), "?") for i, m in enumerate(members)
               if not torch.isfinite(amaxes[i])]
        raise ValueError(f"NaN or Inf in the weights of {', '.join(bad) or 'a Hadamard amax'}: "
                         "the NVFP4 all-gather has no global amax to quantize them with")
    own = {id(m): amaxes[i] for i, m in enumerate(members)}
    for m in layers:
        plan = m.nvfp4_gather
        if m.amax_group is not None:
            plan.amax = torch.stack([own[id(s)] for s in m.amax_group]).amax()
        elif m.weight_amax is not None:
            plan.amax = m.weight_amax.float()
        else:
            plan.amax = own[id(m)]
        plan.dgrad_amax = own[id(m)] if plan.dgrad_spec is not None else None
    for m, attr, i in extra:
        setattr(m.nvfp4_gather, attr, amaxes[i])


def install(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Refresh the amaxes before every forward of `model` (call after `fully_shard`: the hook
    runs before FSDP2's own, whose all-gathers need them)."""
    key = id(model)
    register_group(key, group)
    for m in model.modules():
        if getattr(m, "nvfp4_gather", None) is not None:
            m.nvfp4_gather.key = key
    model.register_forward_pre_hook(lambda module, args: refresh_amaxes(module, group),
                                    prepend=True)


def gathered_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes this rank sent in NVFP4 all-gathers so far, number of those gathers)."""
    plans = [m.nvfp4_gather for m in model.modules() if getattr(m, "nvfp4_gather", None)]
    return (sum(p.stats["bytes"] for p in plans), sum(p.stats["gathers"] for p in plans))
