"""Writing files the way every fp4stack writer does: complete or not at all, readable as any
new file is (the umask's mode), and no temporary files piling up after a killed save.

A writer writes to `temp_path(path)` (a hidden `.NAME.<pid>.<hex>.tmp` beside `path`), then calls
`publish(tmp, path)`: the temporary file gets the mode `open()` would give a new file, and is
renamed over `path` in one step. A save killed midway leaves its hidden temporary file; the next
save of the same file removes it. Two saves of one file at the same time are not supported.
"""

from __future__ import annotations

import glob
import os
import threading
import uuid
from pathlib import Path

_UMASK_LOCK = threading.Lock()


def new_file_mode() -> int:
    """The mode `open()` gives a new file under this process's umask (0o644 under 0o022)."""
    try:  # Linux reports the umask without changing it
        with open("/proc/self/status") as f:
            mask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        with _UMASK_LOCK:  # elsewhere reading it means setting it: briefly, to a strict one
            mask = os.umask(0o077)
            os.umask(mask)
    return 0o666 & ~mask


def temp_path(path: Path) -> Path:
    """A hidden temporary name beside `path`, `.NAME.<pid>.<hex>.tmp`, after deleting the ones of
    that pattern an earlier save left when it was killed (so they never pile up; two saves of one
    file at the same time are not supported)."""
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        stale.unlink(missing_ok=True)
    return path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"


def publish(tmp: Path, path: Path) -> None:
    """Rename the complete `tmp` to `path` with the mode of any new file (writers such as
    safetensors' create theirs owner-only, which would keep a server under another user out)."""
    os.chmod(tmp, new_file_mode())
    os.replace(tmp, path)


def make_output_dir(path: Path) -> Path:
    """`path` created as a directory (with its parents) for a run's output; ValueError naming it
    when a file, not a directory, is in the way."""
    path = Path(path)
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            raise ValueError(f"output directory {path}: {p} is a file, not a directory; choose "
                             "another --out")
    path.mkdir(parents=True, exist_ok=True)
    return path


__all__ = ["make_output_dir", "new_file_mode", "publish", "temp_path"]
