"""Where recipe files live, and how one is read: `NAME.yaml`, a recipe mapping found by name.

A recipe that is a preset with some fields changed (an ablation of a study) is a YAML file
holding a recipe mapping (fp4stack.nn.recipe_mapping), top-level or under a `recipe` key. A name
is looked for in the directories of the environment variable FP4STACK_RECIPE_PATH
(os.pathsep-separated, first match wins), then in the source checkout's configs/recipes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config_fields import read_yaml

RECIPE_PATH_ENV = "FP4STACK_RECIPE_PATH"
SUFFIX = ".yaml"
# Present in a source checkout (the package two levels below the repository root), not in a wheel.
CHECKOUT_RECIPES = Path(__file__).resolve().parents[2] / "configs" / "recipes"


def recipe_dirs() -> list[Path]:
    """The directories searched for NAME.yaml, in order: FP4STACK_RECIPE_PATH's, then the source
    checkout's configs/recipes (when it exists)."""
    dirs = [Path(d) for d in os.environ.get(RECIPE_PATH_ENV, "").split(os.pathsep) if d]
    if CHECKOUT_RECIPES.is_dir():
        dirs.append(CHECKOUT_RECIPES)
    return dirs


def find_recipe_file(name: str) -> Path | None:
    """The first `name`.yaml in `recipe_dirs()`, or None (also for a name that is a path)."""
    if not name or name.startswith(".") or "/" in name or os.sep in name:
        return None
    for d in recipe_dirs():
        path = d / f"{name}{SUFFIX}"
        if path.is_file():
            return path
    return None


def recipe_file_names() -> list[str]:
    """The names of the recipe files found in `recipe_dirs()`, sorted."""
    return sorted({p.stem for d in recipe_dirs() for p in d.glob(f"*{SUFFIX}") if p.is_file()})


def read_recipe_file(path: str | os.PathLike) -> Any:
    """The recipe mapping a YAML file holds (under its `recipe` key, or top-level); unchecked."""
    data = read_yaml(path)
    return data.get("recipe", data) if isinstance(data, Mapping) else data


__all__ = ["CHECKOUT_RECIPES", "RECIPE_PATH_ENV", "find_recipe_file", "read_recipe_file",
           "recipe_dirs", "recipe_file_names"]
