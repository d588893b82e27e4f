"""MoE experts in the compressed-tensors NVFP4 layout, under the names of the model's checkpoints.

fp4stack holds an MoE layer's experts stacked (fp4stack's `Experts` and transformers 5.x fused
experts alike: gate_up_proj [E, 2I, D], down_proj [E, D, I]); published NVFP4 MoE checkpoints,
vLLM and transformers' loaders hold one linear per expert and projection. The export writes, per
expert `e` of an experts module, three quantized linears as `compressed_tensors` writes any other:

    <experts>.{e}.gate_proj.{weight_packed, weight_scale, weight_global_scale,
                             input_global_scale (W4A4)}    rows [:I] of the expert's gate_up
    <experts>.{e}.up_proj.*                                 rows [I:2I]
    <experts>.{e}.down_proj.*

under the names the model's checkpoints use. For a transformers model they are what transformers'
own reverse weight conversion (the one `save_pretrained` runs) gives: Qwen3-MoE and OLMoE
`model.layers.{i}.mlp.experts.{e}.gate_proj`, Mixtral `model.layers.{i}.block_sparse_moe.
experts.{e}.w1` (gate), `w3` (up), `w2` (down), its router `block_sparse_moe.gate`. fp4stack's
GPT keeps its module names (`model.layers.{i}.mlp.experts.{e}.gate_proj`, Qwen3's).

Scales. An expert's gate and up rows are one weight, quantized with one global amax, so their
`weight_global_scale`s are equal, as vLLM's fused w13 GEMM needs. Activations (W4A4): each expert's
calibrated input amax (`fp4stack.convert.calibrate`), per projection; gate and up see the same
input and store the same `input_global_scale`; an expert no calibration token reached stores the
largest of its layer's (see `ExpertQuantization.finish_calibration`). Unconverted experts are
written per expert unquantized (`<...>.weight`) and listed in the config's `ignore`, with the
routers, which are never quantized.

transformers (5.24, with compressed-tensors 0.20) loads such a checkpoint without an error but
with wrong experts: its `CompressedTensorsDequantize` rebuilds each expert from `weight_packed`
and `weight_scale` and drops `weight_global_scale`. `save_quantized` says so once per save
(`TransformersMoEWarning`) when the checkpoint has a config transformers reads, and
`fp4stack.restore_expert_weights` (transformers_experts.py) repairs a model so loaded.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch
from torch import nn

from .api import dequantize, quantize
from .compressed_tensors_read import Checkpoint, unit_tensor
from .formats.spec import QuantSpec
from .formats.tensor import NVFP4Tensor
from .nn.moe import Experts
from .nn.quant_experts import ExpertQuantization, is_hf_fused_experts

PARTS = ("gate_proj", "up_proj", "down_proj")  # the model-side names of an expert's linears
TRANSFORMERS_MOE_NOTE = (
    "transformers 5.24 (the version tested; check yours) loads this checkpoint's quantized MoE "
    "experts wrongly: it dequantizes each expert from weight_packed and weight_scale without its "
    "weight_global_scale, so the experts it holds are scaled by that global scale (2688/amax). "
    "After AutoModelForCausalLM.from_pretrained(dir), call "
    "fp4stack.restore_expert_weights(model, dir), which decompresses them again with the global "
    "scale; or read the checkpoint with fp4stack.load_quantized into a model converted the same "
    "way. The dense layers are unaffected")


class TransformersMoEWarning(UserWarning):
    """A saved MoE checkpoint whose experts transformers would dequantize wrongly (see
    TRANSFORMERS_MOE_NOTE)."""


def expert_name(module_name: str, e: int, part: str) -> str:
    """The model-side name of one expert's linear (`<experts>.{e}.gate_proj`); the checkpoint's
    comes from `checkpoint_names`."""
    return f"{module_name}.{e}.{part}"


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every stacked-experts module of `model` by name, converted or not."""
    return {n: m for n, m in model.named_modules()
            if isinstance(m, ExpertQuantization | Experts) or is_hf_fused_experts(m)}


def is_router(module: nn.Module) -> bool:
    """A transformers 5.x MoE router (Qwen3MoeTopKRouter, ...), which holds its weight itself."""
    return type(module).__name__.endswith("Router") and isinstance(
        getattr(module, "weight", None), nn.Parameter)


def spec(module: nn.Module) -> QuantSpec | None:
    """How an experts module's weights are quantized (None: not at all)."""
    if not isinstance(module, ExpertQuantization):
        return None
    slot = module.packed_slots().get("gate_up")
    s = slot.spec if slot is not None else module.recipe.w
    return None if s.format == "none" else s


def dims(module: nn.Module) -> tuple[int, int, int]:
    """(E, I, D): experts, each expert's hidden size, the model dim."""
    w = getattr(module, "gate_up_proj", None)
    if w is not None:
        return w.shape[0], w.shape[1] // 2, w.shape[2]
    slot = module.packed_slots()["gate_up"]
    return slot.count, slot.shape[0] // 2, slot.shape[1]


def check_exportable(name: str, module: ExpertQuantization, weight_only: bool) -> bool:
    """Refuse what the format cannot hold (naming the module); True when exported W4A4."""
    _, hidden, dim = dims(module)
    s, recipe = spec(module), module.recipe
    if s.format == "fp8":
        raise ValueError(f"experts {name!r}: FP8 weights (recipe {recipe.name!r}) are not NVFP4; "
                         "the nvfp4-pack-quantized format holds NVFP4 weights only")
    for what, k in (("the model dim", dim), ("the expert hidden size", hidden)):
        if k % 16:
            raise ValueError(f"experts {name!r}: {what} {k} is not a multiple of 16, which "
                             "compressed-tensors and vLLM require for NVFP4 weights")
    if recipe.x.format == "fp8" and not weight_only:
        raise ValueError(f"experts {name!r}: FP8 activations cannot be exported with NVFP4 "
                         "weights; pass weight_only=True for W4A16")
    return recipe.x.format == "nvfp4" and not weight_only


def _rows(t: NVFP4Tensor, start: int, stop: int) -> NVFP4Tensor:
    return NVFP4Tensor(t.data[start:stop], t.scales[start:stop], t.amax,
                       (stop - start, t.shape[1]), t.spec)


def _cat(a: NVFP4Tensor, b: NVFP4Tensor) -> NVFP4Tensor:
    return NVFP4Tensor(torch.cat([a.data, b.data]), torch.cat([a.scales, b.scales]), a.amax,
                       (a.shape[0] + b.shape[0], a.shape[1]), a.spec)


def _stacked(module: ExpertQuantization, proj: str, e: int) -> NVFP4Tensor:
    # The weight the forward multiplies by: a master one quantized as quant_expert_linear does.
    w = getattr(module, f"{proj}_proj")
    if w is None:
        return module.packed_expert(proj, e)
    return quantize(w[e].detach(), spec=module.recipe.w, name=f"{proj}_proj[{e}]")


def export_units(name: str, module: ExpertQuantization, w4a4: bool
                 ) -> Iterator[tuple[str, NVFP4Tensor, torch.Tensor | None]]:
    """(model-side name, NVFP4 weight, activation amax or None) of every expert's linears."""
    n_experts, hidden, _ = dims(module)
    for e in range(n_experts):
        gate_up = _stacked(module, "gate_up", e)
        weights = (_rows(gate_up, 0, hidden), _rows(gate_up, hidden, 2 * hidden),
                   _stacked(module, "down", e))
        for part, t, row in zip(PARTS, weights, (0, 0, 1), strict=True):
            x_amax = module.x_amax[row, e] if w4a4 else None
            yield expert_name(name, e, part), t, x_amax


def plain_tensors(name: str, module: nn.Module) -> dict[str, torch.Tensor]:
    """An unconverted experts module's weights per expert, `<expert linear>.weight`, as views of
    its stacks (so a load copies into them)."""
    gate_up, down = module.gate_up_proj.detach(), module.down_proj.detach()
    hidden = gate_up.shape[1] // 2
    out = {}
    for e in range(gate_up.shape[0]):
        for part, w in zip(PARTS, (gate_up[e, :hidden], gate_up[e, hidden:], down[e]),
                           strict=True):
            out[f"{expert_name(name, e, part)}.weight"] = w
    return out


def read_units(name: str, module: ExpertQuantization, ckpt: Checkpoint
               ) -> tuple[list[NVFP4Tensor], list[NVFP4Tensor], torch.Tensor | None]:
    """The checked per-expert gate_up and down weights of one experts module and its x_amax
    [2, E] (None when the checkpoint has no input scales for it)."""
    n_experts, hidden, dim = dims(module)
    s = spec(module)
    gate_up, down, x_amax = [], [], []
    for e in range(n_experts):
        (g, xg), (u, xu), (d, xd) = (
            unit_tensor(expert_name(name, e, part), shape, s, ckpt)
            for part, shape in zip(PARTS, ((hidden, dim), (hidden, dim), (dim, hidden)),
                                   strict=True))
        if g.amax.item() != u.amax.item():
            gs = f"{expert_name(name, e, 'up_proj')}.weight_global_scale"
            raise ValueError(f"{ckpt.where(gs)}: expert {e}'s gate and up projections have "
                             "different global scales; fp4stack (and vLLM's fused gate/up GEMM) "
                             "quantize them as one weight with one scale")
        gate_up.append(_cat(g, u))
        down.append(d)
        x_amax.append(None if xg is None or xu is None or xd is None
                      else torch.stack([torch.maximum(xg, xu), xd]))
    if all(x is None for x in x_amax):
        return gate_up, down, None
    if any(x is None for x in x_amax):
        raise ValueError(f"experts {name!r}: the checkpoint has input_global_scale for some of "
                         "their linears only; it must have it for all or none")
    return gate_up, down, torch.stack(x_amax, dim=1)


@torch.no_grad()
def fill(module: ExpertQuantization, gate_up: list[NVFP4Tensor], down: list[NVFP4Tensor],
         x_amax: torch.Tensor | None) -> None:
    """Load read weights: packed stacks bit for bit; master stacks get the dequantized values
    (their forward re-quantizes them)."""
    dev = None
    for proj, ts in (("gate_up", gate_up), ("down", down)):
        w = getattr(module, f"{proj}_proj")
        if w is None:
            module.write_packed(proj, ts)
            dev = module.read_packed(proj, 0).data.device
        else:
            dev = w.device
            for e, t in enumerate(ts):
                w[e].copy_(dequantize(t.to(dev), w.dtype))
    if x_amax is not None:
        module.x_amax = x_amax.to(dev)


def _is_transformers_model(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def checkpoint_names(model: nn.Module, plain: list[str], layers: list[str],
                     experts: dict[str, nn.Module]) -> dict[str, str]:
    """Model-side name -> checkpoint name: of each plain tensor (`plain`: state-dict keys), each
    quantized linear layer (`layers`: module names, whose tensors are `<name>.<suffix>`) and each
    expert's linear (`expert_name`). Identity unless `model` is a transformers model with experts:
    then transformers' reverse weight conversion names them, as its `save_pretrained` would."""
    names = dict.fromkeys(plain) | dict.fromkeys(layers)
    for name, module in experts.items():
        names.update(dict.fromkeys(expert_name(name, e, p)
                                   for e in range(dims(module)[0]) for p in PARTS))
    if not (experts and _is_transformers_model(model)):
        return {k: k for k in names}
    return _transformers_names(model, plain, layers, experts)


def _reverted(model: nn.Module, state: dict[str, torch.Tensor], revert) -> dict:
    # A model loaded from a quantized checkpoint keeps the loader's conversions, its quantizer's
    # dequantize among them, which has no reverse: the architecture's own mapping names it.
    loaded = getattr(model, "_weight_conversions", None)
    if loaded is None or getattr(model, "hf_quantizer", None) is None:
        return revert(model, state)
    del model._weight_conversions
    try:
        return revert(model, state)
    finally:
        model._weight_conversions = loaded


def _transformers_names(model: nn.Module, plain: list[str], layers: list[str],
                        experts: dict[str, nn.Module]) -> dict[str, str]:
    # A probe state dict whose every element is a distinct id, through the conversion
    # transformers' save_pretrained applies (renames, per-expert split, gate/up chunk): where
    # each id lands names the tensor it stands for. Expert stacks are probed as [E, 2, 1] (gate,
    # up) and [E, 1, 1] (down), the tensors' layout along the dims the conversion splits.
    from transformers.core_model_loading import revert_weight_conversion

    ids: list[tuple[str, bool]] = []  # (model-side name, whether a layer's prefix)

    def probe(*entries: tuple[str, bool]) -> list[float]:
        ids.extend(entries)
        return [float(i) for i in range(len(ids) - len(entries), len(ids))]

    state: dict[str, torch.Tensor] = {}
    for key in plain:
        state[key] = torch.tensor(probe((key, False)), dtype=torch.float64)
    for name in layers:
        state[f"{name}.weight"] = torch.tensor(probe((name, True)), dtype=torch.float64)
    for name, module in experts.items():
        n = dims(module)[0]
        gate_up = [probe(*((expert_name(name, e, p), True) for p in PARTS[:2])) for e in range(n)]
        down = [probe((expert_name(name, e, PARTS[2]), True)) for e in range(n)]
        state[f"{name}.gate_up_proj"] = torch.tensor(gate_up, dtype=torch.float64)[..., None]
        state[f"{name}.down_proj"] = torch.tensor(down, dtype=torch.float64)[..., None]
    names: dict[str, str] = {}
    for key, t in _reverted(model, state, revert_weight_conversion).items():
        values = t.flatten().tolist()
        if len(values) != 1 or ids[int(values[0])][0] in names:
            raise ValueError(f"{type(model).__name__}: transformers' weight conversion does not "
                             f"map fp4stack's tensors one to one onto checkpoint names (at "
                             f"{key!r}); this architecture's MoE export is not supported")
        name, prefix = ids[int(values[0])]
        names[name] = key.removesuffix(".weight") if prefix else key
    missing = [name for name, _ in ids if name not in names]
    if missing:
        raise ValueError(f"{type(model).__name__}: transformers' weight conversion drops "
                         f"{missing[:3]}; this architecture's MoE export is not supported")
    return names
