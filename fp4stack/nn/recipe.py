"""The methods' recipe presets, and `recipe()`: a Recipe from a name, a mapping or a Recipe.

A preset is a method as the library ships it: BF16, FP8, NVFP4, NVIDIA's recipe, Four Over Six,
the low-rank branch and split, Full-Stack FP4 (fp4stack's and the paper's form), weight-only QAT
and the inference formats. A study's ablation is a preset
with some fields changed, kept as data: a recipe file, configs/recipes/NAME.yaml
(fp4stack.nn.recipe_files), found by its name as a preset is. "NAME@SCOPE" (`scoped`) quantizes
only part of a recipe's linears. The types are in fp4stack.nn.recipe_types.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..config_fields import suggest
from ..formats.spec import QuantSpec
from .attention_quant import AttentionQuant
from .recipe_files import (
    RECIPE_PATH_ENV,
    find_recipe_file,
    read_recipe_file,
    recipe_dirs,
    recipe_file_names,
)
from .recipe_mapping import recipe_from_mapping
from .recipe_types import LINEAR_OPERANDS, LowRank, Recipe, ResidualCompensation


def _nvfp4(**kw) -> QuantSpec:
    # Layers run on hot paths: no per-call NaN check (a host sync); training checks the loss.
    return QuantSpec(nan_policy="propagate", **kw)


def _presets() -> dict[str, Recipe]:
    rne = _nvfp4()
    fp8 = replace(QuantSpec.fp8("block128"), nan_policy="propagate")  # hot path: no host sync
    nvfp4 = Recipe("nvfp4", x=rne, w=rne, dy=rne, w_dgrad=rne, x_wgrad=rne, dy_wgrad=rne)
    w4a4 = Recipe("w4a4", x=rne, w=rne, weight_storage="packed")
    # Four Over Six block scales (each block mapped to 4 or 6, the lower error) on every operand.
    four_six = _nvfp4(four_over_six=True)
    nvfp4_46 = Recipe("nvfp4-4over6", **dict.fromkeys(LINEAR_OPERANDS, four_six))
    # SVDQuant's split as Full-Stack FP4 (arXiv 2607.04422) uses it: W's principal rank-r part in
    # BF16, only W - L in NVFP4, refitted every 4,000 training forwards.
    split = LowRank(refresh_every=4000, fit="weight")
    # Full-Stack FP4: lowrank linears, NVFP4 optimizer states, FP4 attention with reuse.
    fullstack = nvfp4.with_(name="fullstack", lowrank=LowRank(), optimizer_states="nvfp4",
                            attention=AttentionQuant.paper())
    # NVIDIA's quantizers (arXiv 2509.25149): 2D weights, stochastic rounding of gradients, a
    # 16-point random Hadamard transform on the wgrad operands; here on every block.
    nvidia = Recipe(
        "nvfp4-nvidia",
        x=rne,
        w=_nvfp4(block=(16, 16)),
        dy=_nvfp4(rounding="stochastic"),
        w_dgrad=None,  # 16x16 tiles: Q(W)ᵀ is Q(Wᵀ), so the forward's weight is reused
        x_wgrad=_nvfp4(hadamard=True),
        dy_wgrad=_nvfp4(hadamard=True, rounding="stochastic"),
    )
    return {
        "bf16": Recipe("bf16"),
        "fp8": Recipe("fp8", x=fp8, w=fp8, dy=fp8, w_dgrad=fp8, x_wgrad=fp8, dy_wgrad=fp8),
        "nvfp4": nvfp4,
        # NVIDIA's recipe keeps some blocks in BF16 (here the first and the last).
        "nvfp4-nvidia": nvidia.with_(keep_first_blocks=1, keep_last_blocks=1),
        "lowrank": nvfp4.with_(name="lowrank", lowrank=LowRank()),
        "lowrank-nvidia": nvidia.with_(name="lowrank-nvidia", lowrank=LowRank()),
        "fullstack": fullstack,
        "nvfp4-4over6": nvfp4_46,
        "lowrank-svd": nvfp4.with_(name="lowrank-svd", lowrank=split),
        "lowrank-svd-4over6": nvfp4_46.with_(name="lowrank-svd-4over6", lowrank=split),
        # Full-Stack FP4 as the paper describes it: 4/6 linears split by SVD, NVFP4 optimizer
        # states with AdamW4's v stored as sqrt, centred, Hadamard-transformed, attention with
        # the QKᵀ and dS GEMMs in NVFP4 and Q̂, K̂ reused. The run names the optimizer (root4).
        "fullstack-paper": nvfp4_46.with_(name="fullstack-paper", lowrank=split,
                                          optimizer_states="nvfp4",
                                          adamw4_transform="sqrt-center-hadamard",
                                          attention=AttentionQuant.qk_ds()),
        # The best full stack: fullstack on NVIDIA's linear quantizers (every block, every GEMM
        # NVFP4), its attention's backward re-quantizing Q, K, V instead of reusing the forward's.
        "fullstack-nvidia-noreuse": fullstack.with_(
            name="fullstack-nvidia-noreuse", attention=AttentionQuant(reuse=False),
            **{f: getattr(nvidia, f) for f in LINEAR_OPERANDS}),
        "qat-w": Recipe("qat-w", w=rne),
        "w8a8": Recipe("w8a8", x=fp8, w=fp8),  # FP8 rollouts: 1x128 activations, 128 weights
        "w4a4": w4a4,
        "w4a4-rc": w4a4.with_(name="w4a4-rc", compensation=ResidualCompensation()),
        # Per-token activation scaling (a global scale per row of x, as Transformer Engine's
        # row-scaled NVFP4 activations): a token's quantization no longer depends on the other
        # tokens of its batch, nor on which expert it is routed to.
        "w4a4-token": w4a4.with_(name="w4a4-token", x=_nvfp4(global_scale="row")),
        "w4a4-rc-token": w4a4.with_(name="w4a4-rc-token", x=_nvfp4(global_scale="row"),
                                    compensation=ResidualCompensation()),
    }


PRESETS: dict[str, Recipe] = _presets()

# "NAME@SCOPE" keeps one part of the recipe's linear quantization and runs the rest of every
# linear GEMM on unquantized operands; attention and optimizer states stay as they are. It
# ablates which operands of the linears cost the loss. The wgrad pair moves together because a
# Hadamard transform on one of them cancels only against the other.
SCOPES: dict[str, tuple[str, ...]] = {
    "forward": ("x", "w"),  # fprop; dgrad and wgrad in high precision
    "backward": ("dy", "w_dgrad", "x_wgrad", "dy_wgrad"),  # dgrad and wgrad; fprop exact
    "weights": ("w", "w_dgrad"),  # W wherever it is multiplied (fprop, dgrad)
}


def scoped(r: Recipe, scope: str) -> Recipe:
    """`r` with only the linear operands of `scope` (a SCOPES key) quantized."""
    if scope not in SCOPES:
        raise ValueError(f"recipe scope {scope!r} is unknown; choose one of {list(SCOPES)}")
    keep = SCOPES[scope]
    ops = {name: getattr(r, name) for name in LINEAR_OPERANDS}
    # A backward operand of None reuses the forward's quantized tensor; when the forward
    # operand is dropped, the backward quantizes the master tensor the same way instead.
    for backward, forward in (("w_dgrad", "w"), ("x_wgrad", "x")):
        if ops[backward] is None and forward not in keep:
            ops[backward] = ops[forward]
    ops = {name: spec if name in keep else QuantSpec.none() for name, spec in ops.items()}
    w_kept = ops["w"].format != "none"
    return r.with_(name=f"{r.name}@{scope}", **ops,
                   lowrank=r.lowrank if w_kept else None,  # it fits W - Q(W): zero here
                   compensation=r.compensation if ops["x"].format != "none" else None,
                   weight_storage=r.weight_storage if w_kept else "master")


def four_over_six(r: Recipe) -> Recipe:
    """`r` with Four Over Six block scales on every NVFP4 operand of its linears (each block's
    maximum mapped to 4 or to 6, whichever quantizes the block with the lower error); FP8 and
    unquantized operands as they are. `r` itself when it has no NVFP4 operand."""
    changes = {name: replace(spec, four_over_six=True) for name in LINEAR_OPERANDS
               if (spec := getattr(r, name)) is not None and spec.format == "nvfp4"
               and not spec.four_over_six}
    if not changes:
        return r
    return r.with_(name=f"{r.name}+4over6", **changes)


def preset_names() -> list[str]:
    """The presets' names (recipe files add more: `recipe_file_names()`)."""
    return list(PRESETS)


def recipe(name: str | Recipe | Mapping[str, Any]) -> Recipe:
    """A Recipe as it is, a mapping (a recipe with fields changed: `recipe_mapping`), or a name:
    a preset's (`preset_names()`) or a recipe file's (`recipe_file_names()`: NAME.yaml in the
    directories of FP4STACK_RECIPE_PATH, then in configs/recipes). "NAME@SCOPE" quantizes only
    the SCOPE part of the recipe's linears (forward, backward or weights; `scoped`)."""
    if isinstance(name, Recipe):
        return name
    if isinstance(name, Mapping):
        return _own_name(recipe_from_mapping(name, recipe))
    if not isinstance(name, str):
        raise ValueError(f"a recipe is a preset name, a mapping or a Recipe, got {name!r}")
    return _named(name, ())


def _named(name: str, loading: tuple[str, ...]) -> Recipe:
    # `loading`: the recipe files whose bases are being looked up, to report a cycle.
    base, at, scope = name.partition("@")
    path = find_recipe_file(base)
    if base in PRESETS:
        if path is not None:
            raise ValueError(f"recipe {base!r} is both a preset and the recipe file {path}; "
                             "a preset cannot be redefined: rename the file (and its name)")
        r = PRESETS[base]
    elif path is not None:
        r = _from_file(base, path, loading)
    else:
        raise ValueError(_unknown(base))
    return scoped(r, scope) if at else r


_FILE_RECIPES: dict[Path, Recipe] = {}  # a recipe file is read and built once


def _from_file(name: str, path: Path, loading: tuple[str, ...]) -> Recipe:
    key = path.resolve()
    if key in _FILE_RECIPES:
        return _FILE_RECIPES[key]
    if name in loading:
        raise ValueError(f"recipe files {' -> '.join((*loading, name))}: each is based on the "
                         "next (its preset), a cycle")
    try:
        built = recipe_from_mapping(read_recipe_file(path),
                                    lambda base: _named(base, (*loading, name)))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    if built.name != name:
        raise ValueError(f"{path}: recipe.name is {built.name!r}, but the file is found by its "
                         f"name {name!r}: make them the same")
    _FILE_RECIPES[key] = built
    return built


def _own_name(r: Recipe) -> Recipe:
    # Runs are found by name (their directory, compare's rows): a mapping may not take the name
    # of a different recipe that a name finds.
    if r.name in PRESETS and r != PRESETS[r.name]:
        raise ValueError(f"recipe.name: {r.name!r} is a preset's name and this recipe differs "
                         "from that preset; give it a name of its own")
    path = find_recipe_file(r.name)
    if path is not None and r.name not in PRESETS and r != _from_file(r.name, path, ()):
        raise ValueError(f"recipe.name: {r.name!r} is the name of the recipe file {path} and "
                         "this recipe differs from it; give it a name of its own")
    return r


def _unknown(name: str) -> str:
    files = recipe_file_names()
    hint = suggest(name, [*PRESETS, *files])
    dirs = ", ".join(str(d) for d in recipe_dirs()) or "no directory found"
    return (f"unknown recipe {name!r}{hint}; the presets are {list(PRESETS)}, the recipe files "
            f"{files} (in {dirs}), each optionally with @SCOPE ({', '.join(SCOPES)}). To add "
            "one, write NAME.yaml holding a recipe mapping (a preset with fields changed, as in "
            f"configs/recipes) to a directory on {RECIPE_PATH_ENV} or to configs/recipes, or "
            "build a Recipe from QuantSpecs")


__all__ = ["LINEAR_OPERANDS", "PRESETS", "SCOPES", "LowRank", "Recipe", "ResidualCompensation",
           "four_over_six", "preset_names", "recipe", "recipe_file_names", "scoped"]
