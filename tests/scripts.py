"""Load a script of the repository (benchmarks/) as a module, by its path: the scripts are not
a package, and the tests leave sys.path as it is."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative_path: str) -> ModuleType:
    """The module that ROOT/relative_path defines, imported once under its file's stem."""
    path = ROOT / relative_path
    if path.stem in sys.modules:
        return sys.modules[path.stem]
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module
