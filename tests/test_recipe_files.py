"""Recipe files: configs/recipes/NAME.yaml found by name as a preset is (fp4stack.nn.recipe)."""

from __future__ import annotations

import importlib
import os
import re
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest

from fp4stack import recipe
from fp4stack.nn.attention_quant import NVFP4_SR, AttentionQuant
from fp4stack.nn.recipe import PRESETS, preset_names, recipe_file_names, scoped
from fp4stack.nn.recipe_files import read_recipe_file
from fp4stack.nn.recipe_types import LowRank, Recipe
from fp4stack.train.config import PretrainConfig, recipe_arg

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted((ROOT / "configs/recipes").glob("*.yaml"))
BEST = PRESETS["fullstack-nvidia-noreuse"]


@pytest.fixture(autouse=True)
def _no_recipe_path(monkeypatch):
    monkeypatch.delenv("FP4STACK_RECIPE_PATH", raising=False)


def write(directory: Path, name: str, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_every_file_loads_by_name_and_differs_from_its_preset_where_it_says(path):
    mapping = read_recipe_file(path)
    r = recipe(path.stem)
    assert r.name == path.stem and path.stem not in PRESETS
    assert recipe(recipe_arg(str(path))) == r  # by path (`--recipes FILE`) as by name
    assert path.read_text().startswith("# ")  # what the ablation asks
    base = recipe(mapping["preset"])
    written = set(mapping) - {"preset", "name"}
    for f in fields(Recipe):
        if f.name != "name":
            same = getattr(r, f.name) == getattr(base, f.name)
            assert same != (f.name in written), (path.stem, f.name)


def test_file_recipes_are_their_presets_with_the_stated_fields_changed():
    rne, fullstack = PRESETS["nvfp4"].x, PRESETS["fullstack"]
    nvidia_linears = {f: getattr(PRESETS["nvfp4-nvidia"], f)
                      for f in ("x", "w", "dy", "w_dgrad", "x_wgrad", "dy_wgrad")}
    assert recipe("fullstack-nvidia") == fullstack.with_(name="fullstack-nvidia", **nvidia_linears)
    assert recipe("fullstack-ds-hp") == fullstack.with_(name="fullstack-ds-hp",
                                                        attention=AttentionQuant(ds=None))
    sr_qkv = AttentionQuant(q=NVFP4_SR, k=NVFP4_SR, v=NVFP4_SR)
    assert recipe("fullstack-nvidia-sr-qkv") == BEST.with_(name="fullstack-nvidia-sr-qkv",
                                                           attention=sr_qkv)
    assert recipe("fullstack-nvidia-tiles") == BEST.with_(name="fullstack-nvidia-tiles",
                                                          attention=AttentionQuant.tiled())
    four_six = replace(rne, four_over_six=True)
    assert recipe("fullstack-nvidia-noreuse-w1x16-4over6") == BEST.with_(
        name="fullstack-nvidia-noreuse-w1x16-4over6", x=four_six, w=four_six, w_dgrad=rne)
    assert recipe("fullstack-nvidia-noreuse-lora") == BEST.with_(
        name="fullstack-nvidia-noreuse-lora", lowrank=LowRank(trainable=True))
    assert recipe("fullstack-nvidia-noreuse-last-bf16") == BEST.with_(
        name="fullstack-nvidia-noreuse-last-bf16", keep_last_blocks=1)


def test_names_and_scopes_reach_file_recipes_from_python_and_the_cli():
    assert set(recipe_file_names()) == {p.stem for p in FILES}
    assert not set(recipe_file_names()) & set(preset_names())
    assert preset_names() == list(PRESETS)
    r = recipe("fullstack-nvidia-sr-qkv")
    assert recipe("fullstack-nvidia-sr-qkv@forward") == scoped(r, "forward")
    assert recipe({"preset": "fullstack-nvidia-sr-qkv@backward"}) == scoped(r, "backward")
    # --recipe NAME and each of --recipes a,b: recipe_arg passes a name on to the config.
    assert recipe_arg("fullstack-nvidia-tiles") == "fullstack-nvidia-tiles"
    cfg = PretrainConfig(recipe="fullstack-nvidia-tiles@forward")
    assert cfg.recipe_name == "fullstack-nvidia-tiles@forward"


def test_search_order_path_dirs_then_the_checkout(tmp_path, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    write(second, "mine", "recipe: {preset: nvfp4, name: mine, keep_last_blocks: 2}\n")
    write(first, "mine", "preset: nvfp4\nname: mine\nkeep_last_blocks: 1\n")  # top-level too
    # The checkout's file of this name is fullstack-nvidia's; the path's comes first.
    write(second, "fullstack-nvidia", "recipe: {preset: fullstack, name: fullstack-nvidia}\n")
    monkeypatch.setenv("FP4STACK_RECIPE_PATH", os.pathsep.join([str(first), "", str(second)]))
    assert recipe("mine") == PRESETS["nvfp4"].with_(name="mine", keep_last_blocks=1)
    assert recipe("mine@weights") == scoped(recipe("mine"), "weights")
    assert recipe("fullstack-nvidia") == PRESETS["fullstack"].with_(name="fullstack-nvidia")
    assert "mine" in recipe_file_names() and "fullstack-nvidia-tiles" in recipe_file_names()
    assert recipe("fullstack-nvidia-tiles").attention == AttentionQuant.tiled()  # the checkout
    monkeypatch.delenv("FP4STACK_RECIPE_PATH")
    assert recipe("fullstack-nvidia").attention == AttentionQuant(reuse=True)
    with pytest.raises(ValueError, match="unknown recipe 'mine'"):
        recipe("mine")


def test_a_file_recipe_is_read_once(tmp_path, monkeypatch):
    # The module: the package attribute fp4stack.nn.recipe is the function.
    lookup = importlib.import_module("fp4stack.nn.recipe")
    reads = []
    monkeypatch.setattr(lookup, "read_recipe_file",
                        lambda path: reads.append(path) or read_recipe_file(path))
    write(tmp_path, "once", "recipe: {preset: nvfp4, name: once, keep_first_blocks: 1}\n")
    monkeypatch.setenv("FP4STACK_RECIPE_PATH", str(tmp_path))
    assert recipe("once") is recipe("once") and recipe("once@forward").name == "once@forward"
    assert len(reads) == 1


def test_a_preset_and_a_file_of_one_name_is_an_error_naming_both(tmp_path, monkeypatch):
    path = write(tmp_path, "nvfp4", "recipe: {preset: nvfp4}\n")
    monkeypatch.setenv("FP4STACK_RECIPE_PATH", str(tmp_path))
    for name in ("nvfp4", "nvfp4@forward"):
        with pytest.raises(ValueError, match=f"'nvfp4' is both a preset and the recipe file "
                                             f"{re.escape(str(path))}"):
            recipe(name)


def test_unknown_names_list_presets_and_files_and_how_to_add_one():
    with pytest.raises(ValueError) as e:
        recipe("fullstack-nvidia-sr-qvk")
    message = str(e.value)
    assert message.startswith("unknown recipe 'fullstack-nvidia-sr-qvk' (did you mean "
                              "'fullstack-nvidia-sr-qkv'?)")
    assert all(repr(n) in message for n in [*preset_names(), *recipe_file_names()])
    assert "@SCOPE" in message and "FP4STACK_RECIPE_PATH" in message
    assert "write NAME.yaml holding a recipe mapping" in message
    for not_a_name in ("configs/recipes/fullstack-nvidia", ".hidden", ""):
        with pytest.raises(ValueError, match="unknown recipe"):
            recipe(not_a_name)


@pytest.mark.parametrize("files, name, message", [
    ({"other": "recipe: {preset: nvfp4, name: another, keep_last_blocks: 1}"}, "other",
     r"other\.yaml: recipe\.name is 'another', but the file is found by its name 'other'"),
    ({"a": "recipe: {preset: b, name: a, keep_last_blocks: 1}",
      "b": "recipe: {preset: a, name: b, keep_last_blocks: 2}"}, "a",
     r"recipe files a -> b -> a: each is based on the next"),
    ({"typo": "recipe: {preset: nvfp4, name: typo, keep_last_block: 1}"}, "typo",
     r"typo\.yaml: recipe\.keep_last_block: unknown field"),
    ({"listed": "- nvfp4"}, "listed", r"listed\.yaml: recipe: expected a preset name or a mapping"),
])
def test_bad_recipe_files_name_the_file_and_the_field(tmp_path, monkeypatch, files, name,
                                                      message):
    for stem, text in files.items():
        write(tmp_path, stem, text + "\n")
    monkeypatch.setenv("FP4STACK_RECIPE_PATH", str(tmp_path))
    with pytest.raises(ValueError, match=message):
        recipe(name)


def test_a_file_recipe_may_be_a_base_and_its_name_is_its_own():
    r = recipe({"preset": "fullstack-nvidia-sr-qkv", "name": "sr-qkv-last", "keep_last_blocks": 1})
    assert r == recipe("fullstack-nvidia-sr-qkv").with_(name="sr-qkv-last", keep_last_blocks=1)
    assert recipe({"preset": "fullstack-nvidia", "name": "fullstack-nvidia"}) == \
        recipe("fullstack-nvidia")
    with pytest.raises(ValueError, match=r"recipe\.name: 'fullstack-nvidia-tiles' is the name of "
                                         r"the recipe file .*fullstack-nvidia-tiles\.yaml and "
                                         r"this recipe differs"):
        recipe({"preset": "fullstack-nvidia", "name": "fullstack-nvidia-tiles"})


def test_recipe_files_without_pyyaml_say_which_extra(tmp_path, monkeypatch):
    write(tmp_path, "noyaml", "recipe: {preset: nvfp4, name: noyaml, keep_last_blocks: 1}\n")
    monkeypatch.setenv("FP4STACK_RECIPE_PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` raises ImportError
    with pytest.raises(ImportError, match=r"needs PyYAML: pip install 'fp4stack\[train\]'"):
        recipe("noyaml")


def test_readme_names_exactly_the_presets():
    text = (ROOT / "README.md").read_text()
    start, end = "<!-- presets:start -->", "<!-- presets:end -->"
    if start not in text or end not in text:
        pytest.skip(f"README.md has no {start} ... {end} block listing the presets")
    block = text.split(start, 1)[1].split(end, 1)[0]
    quoted = set(re.findall(r"`([^`\s]+)`", block))
    assert set(preset_names()) <= quoted, sorted(set(preset_names()) - quoted)
    names = {q for q in quoted if q.partition("@")[0] in {*preset_names(), *recipe_file_names()}}
    assert names == set(preset_names()), sorted(names - set(preset_names()))
