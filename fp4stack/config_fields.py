"""Checks of config values read from YAML files and command lines.

Each check raises ValueError naming the field, what it must be, and, where a typo is likely, the
closest known name, so a bad config fails before a run starts rather than after.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any


def suggest(key: str, known: Iterable[str]) -> str:
    """` (did you mean 'x'?)` with x the known name closest to `key`; "" when none is close."""
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_keys(d: Any, config_class: type, source: str) -> None:
    """ValueError unless `d` is a mapping whose keys are all fields of the dataclass
    `config_class` (the error names the unknown key and the closest known one)."""
    if not isinstance(d, dict):
        raise ValueError(f"{source}: expected a mapping of config keys, got {type(d).__name__}")
    known = {f.name for f in fields(config_class)}
    for key in d:
        if key not in known:
            raise ValueError(f"{source}: unknown key {key!r}{suggest(str(key), known)}; "
                             f"known keys: {sorted(known)}")


def check_int(name: str, value: Any, minimum: int) -> None:
    """ValueError unless `value` is an integer (not a bool) >= `minimum`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_float(name: str, value: Any) -> float:
    """`value` as a float; ValueError unless it is a finite number >= 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}"
                         + (" (a string; in YAML write 3.0e-4, which reads as a number, not "
                            "3e-4)" if isinstance(value, str) else ""))
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return float(value)


def read_yaml(path: str | os.PathLike, extra: str = "train") -> Any:
    """The data a YAML file holds; ValueError naming the file, line and column when it is not
    valid YAML (PyYAML is imported here: ImportError naming the extra that installs it)."""
    try:
        import yaml
    except ImportError as e:
        raise ImportError(f"reading {path} needs PyYAML: pip install 'fp4stack[{extra}]'") from e
    try:
        return yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"{path}: not valid YAML{where}: {problem}") from None


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


__all__ = ["check_float", "check_int", "check_keys", "positive_int", "read_yaml", "suggest"]
