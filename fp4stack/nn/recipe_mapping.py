"""A Recipe written as data (a YAML mapping): a preset with some of its fields changed.

    recipe:
      preset: fullstack-nvidia-noreuse      # a preset, or a recipe file's name; NAME@SCOPE too
      name: fwd-4over6                      # required when a field changes: it names the run
      x: {four_over_six: true}              # QuantSpec fields over the preset's spec
      w: {block: [1, 16], four_over_six: true}
      w_dgrad: {block: [1, 16]}
      attention: {reuse: true, ablation: {reblock: true}}  # AttentionQuant fields (or null)
      keep_last_blocks: 1

A linear operand is a mapping of QuantSpec fields (applied over the preset's spec, or over
NVFP4 1x16 round-to-nearest when the preset leaves it unquantized), "none" (unquantized) or, for
w_dgrad and x_wgrad, null (reuse the forward's quantized tensor). lowrank, compensation and
attention take a mapping of their own fields, or null to drop them; attention's q, k, v, p, ds
and dp take QuantSpec mappings, "none" or null, and its ablation a mapping of AttentionAblation
fields (over the preset's) or null. Every unknown key is an error naming the field.
A recipe file (fp4stack.nn.recipe_files) holds one such mapping, found by its name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from typing import Any

from ..config_fields import suggest
from ..formats.spec import QuantSpec
from .attention_ablation import AttentionAblation
from .attention_quant import NVFP4_RNE, AttentionQuant
from .recipe_types import LINEAR_OPERANDS, LowRank, Recipe, ResidualCompensation

_SCALARS = ("weight_storage", "activation_amax", "keep_first_blocks", "keep_last_blocks",
            "optimizer_states", "adamw4_transform")
_PARTS = {"lowrank": LowRank, "compensation": ResidualCompensation, "attention": AttentionQuant}
_ATTENTION_SPECS = ("q", "k", "v", "p", "ds", "dp")
KEYS = ("preset", "name", *LINEAR_OPERANDS, *_SCALARS, *_PARTS)


def _unknown(where: str, key: str, known) -> ValueError:
    return ValueError(f"{where}.{key}: unknown field{suggest(str(key), known)}; known fields: "
                      f"{sorted(known)}")


def _spec(where: str, value: Any, base: QuantSpec | None, nullable: bool) -> QuantSpec | None:
    if value is None:
        if not nullable:
            raise ValueError(f"{where}: null (reuse the forward's tensor) is only for w_dgrad "
                             "and x_wgrad; write none for an unquantized operand")
        return None
    if value == "none":
        return QuantSpec.none()
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: expected a mapping of QuantSpec fields or none, "
                         f"got {value!r}")
    known = {f.name for f in fields(QuantSpec)}
    for key in value:
        if key not in known:
            raise _unknown(where, key, known)
    # As the presets' layers: no per-call NaN check (a host sync).
    start = base if base is not None and base.format != "none" else NVFP4_RNE
    try:
        return replace(start, **value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from e


def _part(where: str, cls: type, value: Any, base: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: expected a mapping of {cls.__name__} fields or null, "
                         f"got {value!r}")
    known = {f.name for f in fields(cls)}
    changes = {}
    for key, v in value.items():
        if key not in known:
            raise _unknown(where, key, known)
        if cls is AttentionQuant and key in _ATTENTION_SPECS:
            v = _spec(f"{where}.{key}", v, getattr(base or cls(), key), nullable=True)
        elif cls is AttentionQuant and key == "ablation":
            v = _part(f"{where}.{key}", AttentionAblation, v, getattr(base, key, None))
        changes[key] = v
    try:
        return replace(base, **changes) if base is not None else cls(**changes)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from e


def recipe_from_mapping(m: Mapping[str, Any], named: Callable[[str], Recipe],
                        where: str = "recipe") -> Recipe:
    """The Recipe a mapping describes (see the module docstring), its `preset` looked up by
    `named` (fp4stack.nn.recipe.recipe); errors name the field."""
    if not isinstance(m, Mapping):
        raise ValueError(f"{where}: expected a preset name or a mapping, got {m!r}")
    for key in m:
        if key not in KEYS:
            raise _unknown(where, key, KEYS)
    if not isinstance(m.get("preset"), str):
        raise ValueError(f"{where}.preset: a preset name is required (e.g. nvfp4-nvidia), got "
                         f"{m.get('preset')!r}")
    try:
        base = named(m["preset"])
    except ValueError as e:
        raise ValueError(f"{where}.preset: {e}") from e
    changed = [k for k in m if k not in ("preset", "name")]
    changes: dict[str, Any] = {}
    for key in changed:
        value = m[key]
        if key in LINEAR_OPERANDS:
            nullable = key in ("w_dgrad", "x_wgrad")
            base_spec = getattr(base, key)
            if base_spec is None:  # reused: the forward operand's spec is the one in effect
                base_spec = getattr(base, "w" if key == "w_dgrad" else "x")
            changes[key] = _spec(f"{where}.{key}", value, base_spec, nullable)
        elif key in _PARTS:
            changes[key] = _part(f"{where}.{key}", _PARTS[key], value, getattr(base, key))
        else:
            changes[key] = value
    try:
        built = base.with_(**changes)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from e
    # Runs are found by name (their directory, compare's rows), so two different mappings must
    # not share a derived one: a changed recipe is named by its author.
    name = m.get("name", None if changed else base.name)
    if name is None:
        raise ValueError(f"{where}.name: required when fields of the preset change ({changed}): "
                         "it names the run's directory and its row in comparisons")
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"{where}.name: expected a non-empty string without '/', got {name!r}")
    return built.with_(name=name)
