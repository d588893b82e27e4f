"""Whether a training checkpoint is intact, checked before a resume reads it: each file must be
complete (a safetensors file as long as its header says, a torch zip archive whose members read
back), so that a damaged newest checkpoint is named and an older intact one can take its place."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

REQUIRED = ("state.json", "model.safetensors", "optimizer.pt", "rng_rank0.pt")


def _safetensors_problem(path: Path) -> str:
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return "shorter than a safetensors header"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return "truncated (its header runs past the end of the file)"
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return "not a safetensors file (its header is not JSON)"
    ends = [v["data_offsets"][1] for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v]
    if 8 + n + max(ends, default=0) != size:
        return f"truncated ({size} bytes, its header describes {8 + n + max(ends, default=0)})"
    return ""


def _zip_problem(path: Path) -> str:
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        return f"truncated or not a torch archive ({e})"
    return f"damaged member {bad}" if bad else ""


def checkpoint_problem(path: Path) -> str:
    """"" when the checkpoint directory `path` is intact, else what is wrong, naming the file."""
    for name in REQUIRED:
        if not (path / name).is_file():
            return f"{path / name} is missing"
    try:
        state = json.loads((path / "state.json").read_text())
    except ValueError as e:
        return f"{path / 'state.json'} is not valid JSON ({e})"
    if not isinstance(state, dict) or not {"step", "config"} <= set(state):
        return f"{path / 'state.json'} lacks the step or the config"
    problem = _safetensors_problem(path / "model.safetensors")
    if problem:
        return f"{path / 'model.safetensors'} is {problem}"
    for f in sorted(path.glob("*.pt")):
        problem = _zip_problem(f)
        if problem:
            return f"{f}: {problem}"
    return ""


__all__ = ["REQUIRED", "checkpoint_problem"]
