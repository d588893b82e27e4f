"""A comparison reuses a run directory only when its run was trained with the config asked for.

Both comparisons (`fp4stack compare`, `fp4stack rl-compare`) keep each run in its own directory
and skip, or resume, the runs already there. A run trained with other values (an edited config,
or a default that changed between versions) would otherwise be reported as if it were the run
asked for. Its directory is moved under `<out>/.stale/` instead, where no report looks, and the
run is trained again: nothing is deleted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

STALE_DIR = ".stale"
CONFIG_FILE = "config.json"


def saved_config(run_dir: str | Path, defaults: dict[str, Any]) -> dict[str, Any]:
    """The config the run in run_dir was trained with (its config.json), every field its
    version of fp4stack did not write at `defaults`; {} without config.json."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.exists():
        return {}
    return {**defaults, **json.loads(path.read_text())}


def changed_fields(saved: dict[str, Any], now: dict[str, Any],
                   ignore: Iterable[str] = ()) -> list[str]:
    """The fields of `now` (a config's to_dict()) that `saved` (its config.json, with every
    field filled in) holds with another value, as "name (saved -> now)"."""
    now = json.loads(json.dumps(now))  # JSON's types, as config.json holds them
    skip = set(ignore)
    return [f"{k} ({saved.get(k)!r} -> {v!r})" for k, v in now.items()
            if k not in skip and saved.get(k) != v]


def stale_fields(run_dir: str | Path, now: dict[str, Any], defaults: dict[str, Any],
                 ignore: Iterable[str] = ()) -> list[str]:
    """changed_fields of the run in run_dir (saved_config) against `now`: [] when they agree
    or when the run has no config.json."""
    saved = saved_config(run_dir, defaults)
    return changed_fields(saved, now, ignore) if saved else []


def set_aside(run_dir: Path, out: Path) -> Path:
    """Move run_dir (inside out) to out/.stale/<its path>-<time> and return where it went."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = Path(run_dir).relative_to(out).as_posix().replace("/", "-")
    aside = Path(out) / STALE_DIR / f"{name}-{stamp}"
    aside.parent.mkdir(parents=True, exist_ok=True)
    Path(run_dir).rename(aside)
    return aside
