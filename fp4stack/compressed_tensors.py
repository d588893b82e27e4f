"""NVFP4 checkpoints in the compressed-tensors layout that vLLM loads ("nvfp4-pack-quantized").

`save_quantized` writes a model converted by `quantize_model` as `model.safetensors` plus a
`config.json` with a compressed-tensors `quantization_config`; `load_quantized` reads it back into
a model converted the same way, bit for bit. Per quantized linear layer `<name>`:

    <name>.weight_packed        uint8 [N, K/2]            E2M1 codes, even element in the low nibble
    <name>.weight_scale         float8_e4m3fn [N, K/16]   block scales
    <name>.weight_global_scale  float32 [1]               ENCODE scale 2688 / amax
    <name>.input_global_scale   float32 [1]               2688 / calibrated activation amax (W4A4)
    <name>.bias                 as it is

compressed-tensors and vLLM store the *encode* scale and divide by it (`dequantize`:
`code * (scale / global_scale)`); fp4stack multiplies by the decode scale `amax * (1/2688)`. The
bytes are identical; the fp32 products can differ in the last bit (see tests/test_checkpoint.py),
and so the bf16 ones where that bit decides a rounding tie (tests/test_checkpoint_smollm2.py).
Since 2688 / (2688 / amax) need not give back amax in fp32, the exact amaxes ride along in the
safetensors header metadata (invisible to other readers), so `load_quantized` is bit-exact.

Activations: vLLM's NVFP4 W4A4 needs a static per-tensor activation scale, so a layer that
quantizes activations needs a calibrated `x_amax` (`fp4stack.convert.calibrate`); its runtime
quantizer is plain NVFP4 (1x16, round to nearest). `weight_only=True` exports every layer as W4A16
(compressed-tensors' NVFP4A16 scheme) instead.

MoE experts are written one linear per expert and projection (`compressed_tensors_moe`), under
the names of the model's checkpoints (transformers 5.24 loads those experts without their global
scale: `save_quantized` warns, see `compressed_tensors_moe`). A layer's calibrated QUADS
compensation channels (static mode) ride in the header metadata too, as `rc_channels`: a tensor
of a name vLLM does not know would stop its loader.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import compressed_tensors_moe as moe
from .api import dequantize, quantize
from .compressed_tensors_read import (
    META_KEY,
    PACKED_SUFFIXES,
    RC_KEY,
    WEIGHTS_NAME,
    compensation_channels,
    join,
    layer_tensor,
    mapped,
    read_checkpoint,
    rename,
    weight_spec,
)
from .files import publish, temp_path
from .formats.nvfp4 import global_encode_scale
from .formats.tensor import NVFP4Tensor
from .nn.fused import FUSED_GROUPS
from .nn.linear import QuantLinear

CONFIG_NAME = "config.json"
FORMAT = "nvfp4-pack-quantized"


def _nvfp4_args(dynamic: bool | str) -> dict[str, Any]:
    # The fields of compressed-tensors' NVFP4 preset that every version of it (and vLLM) reads;
    # scale_dtype is left out: older versions forbid unknown fields and E4M3 is the default.
    return {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
            "strategy": "tensor_group", "dynamic": dynamic}


def _is_nvfp4(layer: QuantLinear) -> bool:
    return weight_spec(layer).format == "nvfp4"


def _weight_tensor(name: str, layer: QuantLinear) -> NVFP4Tensor:
    """The NVFP4 weight the layer's forward multiplies by (a master weight is quantized with its
    spec and imposed amax, as the forward does)."""
    t = layer.packed_weight
    if t is None:
        t = quantize(layer.weight.detach(), spec=layer.recipe.w, amax=layer.shared_weight_amax(),
                     name=name)
    return t


def _check_exportable(name: str, layer: QuantLinear, weight_only: bool) -> None:
    if weight_spec(layer).format == "fp8":
        raise ValueError(f"layer {name!r}: FP8 weights (recipe {layer.recipe.name!r}) are not "
                         "NVFP4; the nvfp4-pack-quantized format holds NVFP4 weights only")
    if layer.in_features % 16:
        raise ValueError(f"layer {name!r}: in_features={layer.in_features} is not a multiple of "
                         "16, which compressed-tensors and vLLM require for NVFP4 weights")
    if layer.recipe.lowrank is not None:
        raise ValueError(f"layer {name!r}: the low-rank branch of recipe {layer.recipe.name!r} "
                         "has no place in the compressed-tensors format")
    if layer.recipe.x.format == "fp8" and not weight_only:
        raise ValueError(f"layer {name!r}: FP8 activations cannot be exported with NVFP4 "
                         "weights; pass weight_only=True for W4A16")


def _collect(model: nn.Module, weight_only: bool):
    """The quantized layers with the activation amax each is exported with (None: W4A16), the
    quantized experts modules (with whether W4A4), and the model-side names of what is left
    unquantized (the config's ignore list: linears, routers, unconverted experts)."""
    quant: list[tuple[str, QuantLinear, torch.Tensor | None]] = []
    experts: list[tuple[str, nn.Module, bool]] = []
    ignore: list[str] = []
    uncalibrated: list[str] = []
    stacks = moe.expert_modules(model)
    for name, module in model.named_modules():
        if name in stacks and moe.spec(module) is not None:
            w4a4 = moe.check_exportable(name, module, weight_only)
            if w4a4 and module.x_amax is None:
                uncalibrated.append(name)
            experts.append((name, module, w4a4))
        elif name in stacks:
            ignore += [moe.expert_name(name, e, p) for e in range(moe.dims(module)[0])
                       for p in moe.PARTS]
        elif isinstance(module, QuantLinear) and weight_spec(module).format != "none":
            _check_exportable(name, module, weight_only)
            w4a4 = module.recipe.x.format == "nvfp4" and not weight_only
            if w4a4 and module.x_amax is None:
                uncalibrated.append(name)
            quant.append((name, module, module.x_amax if w4a4 else None))
        elif isinstance(module, nn.Linear | QuantLinear) or moe.is_router(module):
            ignore.append(name)
    if not quant and not experts:
        raise ValueError("save_quantized: the model has no QuantLinear with NVFP4 weights; "
                         "convert it first (fp4stack.quantize_model(model, 'w4a4'))")
    if uncalibrated:
        raise ValueError(
            f"{len(uncalibrated)} layers quantize activations but have no calibrated static "
            f"amax, which vLLM's NVFP4 W4A4 needs (e.g. {uncalibrated[:3]}): run "
            "fp4stack.convert.calibrate(model, batches) first, or pass weight_only=True")
    return quant, experts, ignore


def _plain_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The state_dict minus the QuantLinear internals (bias kept, and the weight of unquantized
    ones) and minus every experts module; and, apart, unconverted experts' weights per expert
    (`compressed_tensors_moe.plain_tensors`)."""
    sd = model.state_dict()
    stacks = moe.expert_modules(model)
    views: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            keep = ("bias",) if _is_nvfp4(module) else ("bias", "weight")
        elif name in stacks:
            keep = ()
            if moe.spec(module) is None:
                views.update(moe.plain_tensors(name, module))
        else:
            continue
        for k in module.state_dict():
            if k not in keep:
                sd.pop(join(name, k), None)
    return sd, views


def _unquantized_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with one name per shared storage."""
    # Tied weights (e.g. lm_head = embed_tokens) are saved once, under the first name, as
    # transformers' save_pretrained does; safetensors refuses shared storage anyway.
    seen: set[tuple] = set()
    out: dict[str, torch.Tensor] = {}
    for k, v in tensors.items():
        key = (v.device, v.untyped_storage().data_ptr(), v.storage_offset(), v.shape, v.dtype)
        if v.numel() and key in seen:
            continue
        seen.add(key)
        out[k] = v
    return out


def _quantization_config(groups: Mapping[str, list[str]], ignore: list[str]) -> dict[str, Any]:
    # "Linear" when one scheme covers every quantized layer (as llm-compressor writes), else the
    # layer names of each scheme.
    used = {kind: names for kind, names in groups.items() if names}
    config_groups = {}
    for i, (kind, names) in enumerate(used.items()):
        config_groups[f"group_{i}"] = {
            "targets": ["Linear"] if len(used) == 1 else list(names),
            "weights": _nvfp4_args(False),
            "input_activations": _nvfp4_args("local") if kind == "w4a4" else None,
            "output_activations": None,
            "format": FORMAT,
        }
    return {"quant_method": "compressed-tensors", "format": FORMAT,
            "quantization_status": "compressed", "config_groups": config_groups,
            "ignore": ignore, "kv_cache_scheme": None, "global_compression_ratio": None}


def _base_config(model: nn.Module, config) -> dict[str, Any]:
    if config is None:
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "to_json_string"):
            return {}
    if hasattr(config, "to_json_string"):  # a transformers PretrainedConfig
        out = json.loads(config.to_json_string(use_diff=False))
    else:
        out = dict(config)
    if not out.get("architectures") and hasattr(getattr(model, "config", None), "to_dict"):
        out["architectures"] = [type(model).__name__]  # vLLM picks the model class from it
    return out


def _warn_unfused(scales: dict[str, torch.Tensor], kind: str) -> None:
    for group in FUSED_GROUPS:
        parents = {n.rpartition(".")[0] for n in scales if n.rpartition(".")[2] == group[0]}
        for parent in parents:
            names = [join(parent, g) for g in group]
            vals = [scales.get(n) for n in names]
            if all(v is not None for v in vals) and len({v.item() for v in vals}) > 1:
                warnings.warn(f"{names} have different {kind} global scales; vLLM fuses them into "
                              "one GEMM with one scale, which mis-scales all but one: convert "
                              "with fp4stack.quantize_model, which shares their amax",
                              stacklevel=3)


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write_all(directory: Path, writers: dict[str, Callable[[Path], None]]) -> None:
    """Write every file to a temporary name first and rename them only when all are complete, so
    a failure never leaves a partial file under a real name (a kill leaves hidden temporary files
    that the next save into the directory removes)."""
    tmps: dict[str, Path] = {}
    try:
        for name, write in writers.items():
            tmps[name] = temp_path(directory / name)
            write(tmps[name])
            _fsync(tmps[name])
        for name, tmp in tmps.items():  # config.json last: it marks the checkpoint as quantized
            publish(tmp, directory / name)
    finally:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)


def save_quantized(model: nn.Module, directory: str | os.PathLike, *, config=None,
                   weight_only: bool = False) -> Path:
    """Write `model` (converted by `quantize_model`) as a compressed-tensors NVFP4 checkpoint.

    Every QuantLinear with NVFP4 weights is stored packed (master weights are quantized as their
    forward does: recipe.w spec and imposed amax). 16x16 weight tiles store exactly in this 1x16
    layout (a tile's scale repeated on its rows); FP8 weights, K not a multiple of 16 and
    low-rank branches raise an error naming the layer. Quantized MoE experts are written one
    linear per expert (`compressed_tensors_moe`). Other tensors (embeddings, norms, lm_head,
    unconverted linears) are saved as they are, under their state_dict names (for a
    transformers MoE model, its checkpoints' names); unconverted linears and experts and the
    routers go to the config's `ignore` list. Calibrated static compensation channels are kept
    in the header metadata.

    config: the config.json to extend (a dict or a transformers config); default `model.config`
        when it has one, else a config.json holding only `quantization_config`.
    weight_only: export W4A16 (NVFP4A16) even for layers that quantize activations.
    Returns the directory. It must hold no other *.safetensors (vLLM would load them too); the
    files appear complete or not at all.
    """
    from safetensors.torch import save_file

    quant, experts, ignore = _collect(model, weight_only)
    state, views = _plain_state(model)
    names = moe.checkpoint_names(model, list(state), [n for n, _, _ in quant],
                                 moe.expert_modules(model))
    tensors = {mapped(names, k): v for k, v in _unquantized_tensors(state | views).items()}
    ignore = [names[n] if n in names else mapped(names, f"{n}.weight").removesuffix(".weight")
              for n in ignore]
    groups: dict[str, list[str]] = {"w4a4": [], "w4a16": []}
    meta: dict[str, dict[str, Any]] = {}
    w_scales: dict[str, torch.Tensor] = {}
    x_scales: dict[str, torch.Tensor] = {}
    units = [(name, _weight_tensor(name, layer), x_amax) for name, layer, x_amax in quant]
    units += [u for name, module, w4a4 in experts for u in moe.export_units(name, module, w4a4)]
    channels = {name: layer.rc_channels for name, layer, _ in quant
                if layer.rc_channels is not None}
    with torch.no_grad():
        for unit, t, x_amax in units:
            name = names[unit]
            t = t.to("cpu")
            gs = global_encode_scale(t.amax, t.spec.scale_max).reshape(1)
            tensors[join(name, "weight_packed")] = t.data
            tensors[join(name, "weight_scale")] = t.scales
            tensors[join(name, "weight_global_scale")] = w_scales[name] = gs
            meta[name] = {"amax": t.amax.item().hex(), "spec": t.spec.to_dict()}
            if unit in channels:
                meta[name][RC_KEY] = channels[unit].tolist()
            if x_amax is not None:
                x_amax = x_amax.detach().float().cpu().reshape(())
                # vLLM quantizes activations with plain NVFP4: E4M3 max 448, whatever the spec.
                x_scales[name] = global_encode_scale(x_amax).reshape(1)
                tensors[join(name, "input_global_scale")] = x_scales[name]
                meta[name]["x_amax"] = x_amax.item().hex()
            groups["w4a4" if x_amax is not None else "w4a16"].append(name)
    _warn_unfused(w_scales, "weight")
    _warn_unfused(x_scales, "input")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    cfg = _base_config(model, config)
    cfg["quantization_config"] = _quantization_config(groups, ignore)
    if experts and "model_type" in cfg:  # a config.json transformers loads the model from
        warnings.warn(moe.TRANSFORMERS_MOE_NOTE, moe.TransformersMoEWarning, stacklevel=2)
    text = json.dumps(cfg, indent=2, sort_keys=True) + "\n"  # fails here, before any write

    directory = Path(directory)
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    others = [p.name for p in directory.iterdir() if p.name != WEIGHTS_NAME and (
        p.name.endswith(".safetensors") or p.name.endswith(".safetensors.index.json"))]
    if others:
        raise FileExistsError(f"{directory} already holds other weights files {sorted(others)}, "
                              "which an inference engine would load too; use an empty directory")
    header = {"format": "pt", META_KEY: json.dumps(meta)}
    try:
        _write_all(directory, {
            WEIGHTS_NAME: lambda p: save_file(tensors, str(p), metadata=header),
            CONFIG_NAME: lambda p: p.write_text(text, encoding="utf-8"),
        })
    except BaseException:
        if created:
            directory.rmdir()
        raise
    return directory


@torch.no_grad()
def _fill(layer: QuantLinear, t: NVFP4Tensor, x_amax: torch.Tensor | None,
          channels: torch.Tensor | None) -> None:
    if layer.weight is None:
        layer.write_packed("weight", [t])
        dev = layer.packed_weight.device
    else:
        dev = layer.weight.device
        layer.weight.copy_(dequantize(t.to(dev), layer.weight.dtype))
        if layer.weight_amax is not None:  # pinned, so Q(weight) re-forms these values
            layer.weight_amax.copy_(t.amax.to(dev))
    if x_amax is not None:
        layer.x_amax = x_amax.to(dev)
    if channels is not None:
        layer.rc_channels = channels.to(dev)


def load_quantized(model: nn.Module, directory: str | os.PathLike) -> None:
    """Fill `model` (converted with the same structure) from a checkpoint of `save_quantized`.

    Packed layers get their codes, scales and amax bit for bit; master-weight layers get the
    dequantized values (and, when they have a `weight_amax` buffer, the checkpoint's amax, so
    that their forward re-quantizes to the same values, except in blocks whose E4M3 scale is
    subnormal); `input_global_scale` sets `x_amax`, stored compensation channels `rc_channels`.
    Quantized experts are filled likewise from their per-expert linears. Other tensors are
    copied by name (the names `save_quantized` writes). Checkpoints of other tools
    (llm-compressor) load too; their amax is derived from the global scale (one fp32 ulp from
    the original at most).
    Nothing read is trusted (`fp4stack.compressed_tensors_read`): a truncated or foreign file,
    an index entry outside `directory`, malformed metadata, missing or unexpected keys, mismatched
    shapes, and NaN, infinite, negative or zero scales or amaxes raise ValueError naming the file
    and the field, before anything is copied.
    """
    directory = Path(directory)
    ckpt = read_checkpoint(directory)
    quant = [(n, m) for n, m in model.named_modules()
             if isinstance(m, QuantLinear) and _is_nvfp4(m)]
    stacks = moe.expert_modules(model)
    experts = [(n, m) for n, m in stacks.items() if moe.spec(m) is not None]
    if not quant and not experts:
        raise ValueError("load_quantized: the model has no QuantLinear with NVFP4 weights; "
                         "convert it first (fp4stack.quantize_model) as it was before saving")
    state, views = _plain_state(model)
    names = moe.checkpoint_names(model, list(state), [n for n, _ in quant], stacks)
    rename(ckpt, {v: k for k, v in names.items()})
    tensors = ckpt.tensors
    plain = _unquantized_tensors(state | views)
    units = [n for n, _ in quant] + [moe.expert_name(n, e, p) for n, m in experts
                                     for e in range(moe.dims(m)[0]) for p in moe.PARTS]
    required = set(plain) | {join(u, s) for u in units for s in PACKED_SUFFIXES}
    optional = {join(u, "input_global_scale") for u in units}
    missing = sorted(required - set(tensors))
    unexpected = sorted(set(tensors) - required - optional)
    if missing or unexpected:
        raise ValueError(f"{directory}: the checkpoint does not match the model: missing keys "
                         f"{missing[:10]}{' ...' if len(missing) > 10 else ''}, unexpected keys "
                         f"{unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}")
    for key, target in plain.items():
        if tensors[key].shape != target.shape:
            raise ValueError(f"{ckpt.where(key)}: the checkpoint has shape "
                             f"{tuple(tensors[key].shape)}, the model {tuple(target.shape)}")
    # Everything is checked before anything is copied: a failed load leaves the model as it was.
    layers = [(layer, *layer_tensor(name, layer, ckpt),
               compensation_channels(name, layer.in_features, ckpt)) for name, layer in quant]
    stacked = [(module, *moe.read_units(name, module, ckpt)) for name, module in experts]
    with torch.no_grad():
        for key, target in plain.items():
            target.copy_(tensors[key])
    for layer, t, x_amax, channels in layers:
        _fill(layer, t, x_amax, channels)
    for module, gate_up, down, x_amax in stacked:
        moe.fill(module, gate_up, down, x_amax)
