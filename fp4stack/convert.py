"""quantize_model: make any PyTorch or Hugging Face model run its GEMMs through a Recipe.

Linear layers become QuantLinear and stacked MoE experts become quantized experts, in place and
sharing the original parameters. The LM head, embeddings and MoE routers stay in high precision
by default; q/k/v and gate/up projections of one block share one global amax, as inference
engines that fuse them require.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from .nn.fused import FUSED_GROUPS
from .nn.linear import QuantLinear
from .nn.moe import Experts
from .nn.quant_experts import (
    ExpertQuantization,
    QuantExperts,
    QuantHFExperts,
    is_hf_fused_experts,
)
from .nn.recipe import Recipe
from .nn.recipe import recipe as get_recipe

_QUANTIZED = (QuantLinear, QuantExperts, QuantHFExperts)
DEFAULT_SKIP = ("lm_head", "embed", "router", "wte", "wpe")
_BLOCK_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


@dataclass
class ConversionSummary:
    """What quantize_model did: converted modules, skipped modules with the reason, amax groups."""

    recipe: str
    converted: list[tuple[str, str]] = field(default_factory=list)  # (name, kind)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name, reason)
    shared_amax: list[list[str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"quantize_model: recipe {self.recipe}: {len(self.converted)} modules converted, "
                 f"{len(self.skipped)} kept in high precision, "
                 f"{len(self.shared_amax)} shared-amax groups"]
        lines += [f"  converted  {name}  ({kind})" for name, kind in self.converted]
        lines += [f"  skipped    {name}  ({reason})" for name, reason in self.skipped]
        return "\n".join(lines)

    def short(self) -> str:
        """The summary in one line: the counts, the first modules kept in high precision and
        the shared-amax groups (str() lists every module with its reason)."""
        kinds = [kind for _, kind in self.converted]
        done = [f"{n} {what}" for n, what in (
            (kinds.count("linear"), "linears"),
            (sum(k.endswith(" experts") for k in kinds), "expert stacks"),
            (kinds.count("fp4 attention"), "blocks' attention in FP4")) if n]
        kept = [name for name, _ in self.skipped if name != "*"]
        notes = [reason for name, reason in self.skipped if name == "*"]
        line = f"quantize_model: recipe {self.recipe}: converted {', '.join(done) or 'nothing'}"
        if kept:
            line += (f"; kept {len(kept)} in high precision ({', '.join(kept[:3])}"
                     f"{', ...' if len(kept) > 3 else ''})")
        if self.shared_amax:
            line += f"; {len(self.shared_amax)} shared-amax groups"
        return line + "".join(f"; {n}" for n in notes)


def _n_blocks(model: nn.Module) -> int:
    idx = [int(m.group(1)) for n, _ in model.named_modules() if (m := _BLOCK_INDEX.search(n + "."))]
    return max(idx) + 1 if idx else 0


def _skip_reason(name: str, skip: tuple[str, ...], recipe: Recipe, n_blocks: int) -> str | None:
    for pattern in skip:
        if pattern in name:
            return f"matches skip pattern {pattern!r}"
    m = _BLOCK_INDEX.search(name + ".")
    if m:
        i = int(m.group(1))
        if i < recipe.keep_first_blocks:
            return f"block {i} of the first {recipe.keep_first_blocks} kept high precision"
        if i >= n_blocks - recipe.keep_last_blocks:
            return f"block {i} of the last {recipe.keep_last_blocks} kept high precision"
    return None


def _kept_by_design(module: nn.Module) -> str | None:
    # Reported so the summary accounts for every weight a user might expect to be quantized.
    if isinstance(module, nn.Embedding):
        return "embedding: a lookup, not a GEMM"
    if type(module).__name__.endswith("Router") and not isinstance(module, nn.Linear):
        return "MoE router: kept in high precision (router flips cause mismatch)"
    return None


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def quantize_model(model: nn.Module, recipe: Recipe | str, skip: tuple[str, ...] = DEFAULT_SKIP,
                   verbose: bool = False) -> ConversionSummary:
    """Swap `model`'s linear layers and stacked experts for quantized ones, in place.

    skip: substrings of module names left in high precision (default: LM head, embeddings,
    routers); the recipe's keep_first_blocks / keep_last_blocks add whole blocks.
    Returns a ConversionSummary (printing it lists what was converted and skipped, and why).
    """
    recipe = get_recipe(recipe)
    summary = ConversionSummary(recipe.name)
    if not recipe.quantizes and recipe.attention is None:
        summary.skipped.append(("*", f"recipe {recipe.name!r} quantizes nothing"))
        return summary
    master = recipe.with_(weight_storage="master")  # pack only after amax groups are known
    n_blocks = _n_blocks(model)
    for name, module in list(model.named_modules()):
        kept = _kept_by_design(module)
        if kept:
            summary.skipped.append((name, kept))
            continue
        is_linear = isinstance(module, nn.Linear) and not isinstance(module, QuantLinear)
        is_experts = isinstance(module, Experts) and not isinstance(module, QuantExperts)
        is_hf = not is_experts and is_hf_fused_experts(module)
        if not (is_linear or is_experts or is_hf):
            continue
        reason = _skip_reason(name, skip, recipe, n_blocks)
        if reason:
            summary.skipped.append((name, reason))
        elif is_linear:
            _set(model, name, QuantLinear.from_linear(module, master))
            summary.converted.append((name, "linear"))
        else:
            q = (QuantExperts.from_experts(module, recipe) if is_experts
                 else QuantHFExperts(module, recipe))
            _set(model, name, q)
            summary.converted.append((name, f"{module.gate_up_proj.shape[0]} experts"))
    if recipe.attention is not None:
        _use_fp4_attention(model, recipe, n_blocks, summary)
    _share_amax(model, summary)
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.recipe = recipe
    if recipe.weight_storage == "packed":
        _pack(model)
    if verbose:
        print(summary)
    return summary


def _use_fp4_attention(model: nn.Module, recipe: Recipe, n_blocks: int,
                       summary: ConversionSummary) -> None:
    from .models.gpt import Attention
    from .nn.attention import make_attend

    found = False
    for name, module in model.named_modules():
        if not isinstance(module, Attention):
            continue
        found = True
        reason = _skip_reason(name, (), recipe, n_blocks)
        if reason:
            summary.skipped.append((name, f"attention: {reason}"))
        else:
            module.attend = make_attend(recipe.attention)
            summary.converted.append((name, "fp4 attention"))
    if not found:
        summary.skipped.append(("*", "attention: FP4 attention plugs into fp4stack GPT blocks "
                                "only; this model's attention is left as it is"))


def _share_amax(model: nn.Module, summary: ConversionSummary) -> None:
    for parent_name, parent in model.named_modules():
        for group in FUSED_GROUPS:
            members = [getattr(parent, g, None) for g in group]
            if all(isinstance(m, QuantLinear) for m in members):
                for m in members:
                    m.amax_group = members
                prefix = f"{parent_name}." if parent_name else ""
                summary.shared_amax.append([prefix + g for g in group])


@torch.no_grad()
def _pack(model: nn.Module) -> None:
    # Freeze each group's shared amax first: packing a member frees its master weight.
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for m in layers:
        if m.amax_group is not None:
            m.weight_amax = m.shared_weight_amax()
    for m in layers:
        m.amax_group = None
        m.pack()


@torch.no_grad()
def calibrate(model: nn.Module, batches, forward=None) -> int:
    """Run `batches` through `model` and fix, in every QuantLinear, the static activation amax
    (used when the recipe has activation_amax="static") and the residual-compensation channels
    (used in compensation mode "static"), and in quantized MoE experts each expert's activation
    amax per projection. `forward(model, batch)` defaults to `model(batch)`.
    Returns the number of batches seen."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear | ExpertQuantization)]
    if not layers:
        raise ValueError("calibrate: the model has no QuantLinear; run quantize_model first")
    for m in layers:
        m.start_calibration()
    n = 0
    for batch in batches:
        model(batch) if forward is None else forward(model, batch)
        n += 1
    if n == 0:
        raise ValueError("calibrate: no batches given")
    for m in layers:
        m.finish_calibration()
    return n


def high_precision_recipe(recipe: Recipe) -> Recipe:
    """`recipe` with every GEMM operand unquantized and FP4 attention off: what a layer runs after
    a precision switch. A trained low-rank branch stays (it is part of the function the model
    learned); a refitted one, which only approximates W - Q(W), goes with the quantization."""
    lowrank = recipe.lowrank if recipe.lowrank is not None and recipe.lowrank.trainable else None
    none = Recipe(recipe.name)  # a recipe's defaults quantize nothing
    return recipe.with_(name=f"{recipe.name}+bf16", x=none.x, w=none.w, dy=none.dy,
                        w_dgrad=None, x_wgrad=None, dy_wgrad=none.dy_wgrad, compensation=None,
                        lowrank=lowrank, attention=None, activation_amax="dynamic")


def to_high_precision(model: nn.Module) -> int:
    """Switch a quantized model's GEMMs and attention to high precision, in place (NVIDIA's
    NVFP4 recipe runs the last part of pretraining so); returns the modules switched.

    Weights stay where they are: a switched layer computes with its master weight. Packed
    layers have none, so they raise ValueError. Optimizer states keep their format."""
    from .models.gpt import Attention

    for name, module in model.named_modules():  # all checked before anything changes
        if isinstance(module, _QUANTIZED) and module.recipe.weight_storage == "packed":
            raise ValueError(f"{name}: packed NVFP4 weights keep no master weight to compute in "
                             "high precision with; use weight_storage='master'")
    switched = 0
    for module in model.modules():
        if isinstance(module, _QUANTIZED):
            if module.recipe.quantizes or module.recipe.lowrank is not None:
                module.recipe = high_precision_recipe(module.recipe)
                switched += 1
        elif isinstance(module, Attention) and "attend" in vars(module):
            del module.attend  # back to the class's scaled_dot_product_attention
            switched += 1
    return switched


@contextmanager
def high_precision(model: nn.Module) -> Iterator[int]:
    """Within the block `model` computes as to_high_precision makes it (yields the modules
    switched); on leaving, every recipe and attention comes back. Buffers and parameters are
    never touched, so what the model computes afterwards is what it computed before."""
    from .models.gpt import Attention

    recipes = [(m, m.recipe) for m in model.modules() if isinstance(m, _QUANTIZED)]
    attends = [(m, m.attend) for m in model.modules()
               if isinstance(m, Attention) and "attend" in vars(m)]
    switched = to_high_precision(model)
    try:
        yield switched
    finally:
        for m, r in recipes:
            m.recipe = r
        for m, attend in attends:
            m.attend = attend
