"""Recipes written as data: a preset with fields changed (fp4stack.nn.recipe_mapping)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml

from fp4stack import recipe
from fp4stack.formats.spec import QuantSpec
from fp4stack.nn.recipe import LINEAR_OPERANDS, PRESETS

W1X16_4OVER6 = """
preset: fullstack-nvidia-noreuse
name: fullstack-nvidia-noreuse-w1x16-4over6
x: {four_over_six: true}
w: {block: [1, 16], four_over_six: true}
w_dgrad: {block: [1, 16]}
"""


@pytest.mark.parametrize("preset, mapping", [
    ("fullstack-nvidia-noreuse-w1x16-4over6", yaml.safe_load(W1X16_4OVER6)),
    ("fullstack-nvidia-noreuse-lora",
     {"preset": "fullstack-nvidia-noreuse", "lowrank": {"trainable": True}}),
    ("fullstack-nvidia-noreuse-last-bf16",
     {"preset": "fullstack-nvidia-noreuse", "keep_last_blocks": 1}),
    ("fullstack-nvidia-noreuse", {"preset": "fullstack-nvidia", "attention": {"reuse": False}}),
    ("fullstack-nvidia-sr-qkv",
     {"preset": "fullstack-nvidia", "attention": {t: {"rounding": "stochastic"} for t in "qkv"}}),
    ("fullstack-nvidia-noreuse-delta",
     {"preset": "fullstack-nvidia", "attention": {"reuse": False, "ablation": {"delta": "dp"}}}),
    ("fullstack-nvidia-reuse-v",
     {"preset": "fullstack-nvidia", "attention": {"reuse": False, "ablation": {"reuse": ["v"]}}}),
    ("fullstack-ds-hp", {"preset": "fullstack", "attention": {"ds": None}}),
    ("lowrank", {"preset": "nvfp4", "lowrank": {}}),
    ("nvfp4", {"preset": "lowrank", "lowrank": None}),
    ("qat-w", {"preset": "bf16", "w": {}}),  # over an unquantized operand: NVFP4 1x16 RNE
])
def test_mappings_rebuild_the_presets(preset, mapping):
    """Presets and recipe files (configs/recipes), as mappings written here."""
    built = recipe({**mapping, "name": preset})
    assert built == recipe(preset)


def test_none_null_and_the_name():
    r = recipe({"preset": "nvfp4", "name": "mine", "dy": "none", "x_wgrad": None,
                "w_dgrad": {"block": [16, 16]}})
    assert r.name == "mine"
    assert r.dy == QuantSpec.none() and r.x_wgrad is None
    assert r.w_dgrad == replace(PRESETS["nvfp4"].w_dgrad, block=(16, 16))
    # A reused operand's changes start from the forward spec that is in effect for it.
    r = recipe({"preset": "nvfp4-nvidia", "name": "mine", "w_dgrad": {"four_over_six": True}})
    assert r.w_dgrad == replace(PRESETS["nvfp4-nvidia"].w, four_over_six=True)
    assert recipe({"preset": "nvfp4"}) == PRESETS["nvfp4"]  # nothing changed: the preset


def test_scoped_preset_in_a_mapping():
    r = recipe({"preset": "nvfp4-nvidia@forward", "name": "fwd", "x": {"four_over_six": True}})
    assert r.name == "fwd" and r.x.four_over_six and r.dy.format == "none"


@pytest.mark.parametrize("mapping, message", [
    ({"preset": "nvfp4", "keep_last_block": 1}, r"recipe\.keep_last_block: unknown field "
                                                 r"\(did you mean 'keep_last_blocks'\?\)"),
    ({"x": {}}, r"recipe\.preset: a preset name is required"),
    ({"preset": "nvfp5"}, r"recipe\.preset: unknown recipe 'nvfp5'"),
    ({"preset": "nvfp4", "w": {"blok": [1, 16]}}, r"recipe\.w\.blok: unknown field \(did you "
                                                   r"mean 'block'\?\)"),
    ({"preset": "nvfp4", "w": {"block": [2, 2]}}, r"recipe\.w: QuantSpec\.block must be"),
    ({"preset": "nvfp4", "w": "fp4"}, r"recipe\.w: expected a mapping of QuantSpec fields"),
    ({"preset": "nvfp4", "x": None}, r"recipe\.x: null .* only for w_dgrad and x_wgrad"),
    ({"preset": "fullstack", "attention": {"reuse": "maybe"}}, r"recipe\.attention: "
                                                               r"AttentionQuant\.reuse"),
    ({"preset": "fullstack", "attention": {"q": {"rounding": "up"}}},
     r"recipe\.attention\.q: QuantSpec\.rounding"),
    ({"preset": "fullstack", "attention": {"resue": False}}, r"recipe\.attention\.resue: "
                                                             r"unknown field"),
    ({"preset": "fullstack", "attention": {"ablation": {"reblok": True}}},
     r"recipe\.attention\.ablation\.reblok: unknown field \(did you mean 'reblock'\?\)"),
    ({"preset": "fullstack", "attention": {"ablation": {"reuse": ["v"]}}},
     r"recipe\.attention: AttentionAblation\.reuse names .* set reuse=False"),
    ({"preset": "fullstack", "attention": {"ablation": "reblock"}},
     r"recipe\.attention\.ablation: expected a mapping of AttentionAblation fields"),
    ({"preset": "nvfp4", "lowrank": {"rank": 0}}, r"recipe\.lowrank: LowRank\.rank must be"),
    ({"preset": "nvfp4", "keep_last_blocks": -1}, r"recipe: Recipe\.keep_first_blocks and "
                                                   r"keep_last_blocks must be >= 0"),
    ({"preset": "nvfp4", "name": 3}, r"recipe\.name: expected a non-empty string"),
    ({"preset": "nvfp4", "name": "a/b"}, r"recipe\.name: expected a non-empty string without"),
    ({"preset": "nvfp4", "x": {}}, r"recipe\.name: required when fields of the preset change"),
    ({"preset": "nvfp4", "name": "lowrank", "x": {"four_over_six": True}},
     r"recipe\.name: 'lowrank' is a preset's name and this recipe differs"),
])
def test_bad_mappings_name_the_field(mapping, message):
    with pytest.raises(ValueError, match=message):
        recipe(mapping)


def test_other_types_are_refused():
    with pytest.raises(ValueError, match="a preset name, a mapping or a Recipe"):
        recipe(4)


def test_lowrank_recipe_files_are_the_linears_of_their_full_stacks():
    """configs/recipes/lowrank-nvidia-*.yaml, read by path (`--recipes FILE`), are each the
    linear operands of the best full stack's variant of the same name."""
    from pathlib import Path

    from fp4stack.train.config import recipe_arg

    files = sorted((Path(__file__).resolve().parents[1] / "configs/recipes")
                   .glob("lowrank-nvidia-*.yaml"))
    assert len(files) == 2
    for path in files:
        r = recipe(recipe_arg(str(path)))
        assert r.name == path.stem
        full = recipe(r.name.replace("lowrank-nvidia", "fullstack-nvidia-noreuse"))
        assert all(getattr(r, f) == getattr(full, f) for f in LINEAR_OPERANDS), path.name
        assert r.lowrank == full.lowrank and r.attention is None
