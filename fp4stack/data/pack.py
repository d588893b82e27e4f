"""A data directory as compressed parts of bounded size, and back.

A machine that is reached only by small transfers (tens of MiB at a time, no network) still
needs the full token shards. `pack` writes the data directory's files as one xz-compressed tar
stream cut into numbered parts of at most `parts_mib` MiB, plus a JSON manifest with the sha256
of every part, of the whole stream and of every file in it:

    PACKDIR/NAME.pack.json  NAME.tar.xz.000  NAME.tar.xz.001  ...

`unpack` checks every part against the manifest before reading any (a part that is missing,
truncated or corrupted is named), rebuilds the stream, extracts only the files the manifest
lists, checks their sha256 and moves the directory into place, as a build does.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from . import build
from .corpus import sha256_file

FORMAT = "fp4stack-data-pack"
MIB = 1 << 20


class _PartWriter:
    """A write-only stream that lands in consecutive part files of at most `part_bytes`."""

    def __init__(self, directory: Path, archive: str, part_bytes: int) -> None:
        self.directory, self.archive, self.part_bytes = directory, archive, part_bytes
        self.parts: list[dict] = []
        self.total = hashlib.sha256()
        self.size = 0
        self._file = None
        self._hash = None
        self._written = 0

    def _open(self) -> None:
        self._close()
        name = f"{self.archive}.{len(self.parts):03d}"
        self.parts.append({"file": name})
        self._file = open(self.directory / name, "wb")  # noqa: SIM115 - closed by _close
        self._hash, self._written = hashlib.sha256(), 0

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self.parts[-1].update(bytes=self._written, sha256=self._hash.hexdigest())
            self._file = None

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        self.total.update(view)
        self.size += len(view)
        while view:
            if self._file is None or self._written == self.part_bytes:
                self._open()
            n = min(len(view), self.part_bytes - self._written)
            self._file.write(view[:n])
            self._hash.update(view[:n])
            self._written += n
            view = view[n:]
        return len(data)

    def close(self) -> None:
        if not self.parts:
            self._open()  # an empty stream still has one (empty) part
        self._close()


def pack(data_dir: str | os.PathLike, out_dir: str | os.PathLike, parts_mib: float = 60,
         name: str | None = None, preset: int = 6) -> Path:
    """Pack the fp4stack data directory `data_dir` into `out_dir`; returns the manifest path.

    parts_mib: the largest part, in MiB (2**20 bytes). preset: xz compression level 0-9.
    """
    src = Path(data_dir).expanduser()
    problem = build._manifest_problem(src / "manifest.json")
    if problem:
        raise ValueError(f"{src} is not an fp4stack data directory: {problem}")
    files = [n for n in build.OUTPUT_FILES if (src / n).is_file()]
    missing = sorted(set(build.OUTPUT_FILES) - set(files))
    if missing:
        raise ValueError(f"{src} lacks {', '.join(missing)}: rebuild it (fp4stack data build)")
    part_bytes = int(parts_mib * MIB)
    if part_bytes < 1:
        raise ValueError(f"parts_mib must be > 0, got {parts_mib}")
    name = name or src.resolve().name
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    archive = f"{name}.tar.xz"
    manifest_path = out / f"{name}.pack.json"
    stale = sorted(out.glob(f"{archive}.[0-9][0-9][0-9]"))
    if stale or manifest_path.exists():
        raise FileExistsError(f"{out} already holds a pack named {name!r}: remove "
                              f"{manifest_path.name} and its parts, or choose another --out")
    records = [{"name": n, "bytes": (src / n).stat().st_size, "sha256": sha256_file(src / n)}
               for n in files]
    writer = _PartWriter(out, archive, part_bytes)
    try:
        with lzma.LZMAFile(writer, "w", preset=preset) as xz, \
                tarfile.open(fileobj=xz, mode="w|") as tar:
            for n in files:
                info = tarfile.TarInfo(n)
                info.size, info.mode = (src / n).stat().st_size, 0o644
                with open(src / n, "rb") as f:
                    tar.addfile(info, f)
        writer.close()
    except BaseException:
        writer.close()
        for part in writer.parts:
            (out / part["file"]).unlink(missing_ok=True)
        raise
    manifest = {"format": FORMAT, "version": 1, "compression": "xz", "archive": archive,
                "bytes": writer.size, "sha256": writer.total.hexdigest(),
                "part_bytes": part_bytes, "parts": writer.parts, "files": records}
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest_path


def _load_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable pack manifest: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: not an {FORMAT} manifest")
    return manifest


def find_manifest(spec: str | os.PathLike) -> Path:
    """The pack manifest named by `spec`: the .pack.json file, or a folder holding exactly one."""
    path = Path(spec).expanduser()
    if path.is_dir():
        found = sorted(path.glob("*.pack.json"))
        if len(found) != 1:
            raise FileNotFoundError(f"{path}: expected one *.pack.json, found {len(found)}: "
                                    "name the manifest file")
        return found[0]
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such pack manifest")
    return path


def verify(manifest_path: str | os.PathLike) -> dict:
    """Check every part beside the manifest (size, sha256) and the whole stream's sha256;
    returns the manifest. Raises naming every missing or damaged part."""
    path = find_manifest(manifest_path)
    manifest = _load_manifest(path)
    problems = []
    total = hashlib.sha256()
    for part in manifest["parts"]:
        f = path.parent / part["file"]
        if not f.is_file():
            problems.append(f"{part['file']} is missing")
            continue
        if f.stat().st_size != part["bytes"]:
            problems.append(f"{part['file']} has {f.stat().st_size} bytes, expected "
                            f"{part['bytes']} (an incomplete copy?)")
            continue
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda fh=fh: fh.read(MIB), b""):
                h.update(block)
                total.update(block)
        if h.hexdigest() != part["sha256"]:
            problems.append(f"{part['file']}: sha256 differs from the manifest (damaged copy)")
    if problems:
        raise ValueError(f"{path}: " + "; ".join(problems) + ": copy those parts again")
    if total.hexdigest() != manifest["sha256"]:
        raise ValueError(f"{path}: the parts are intact but do not form the packed stream "
                         "(parts from another pack?)")
    return manifest


class _PartReader:
    """A read-only stream over the parts, in order."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths, self._file = list(paths), None

    def read(self, n: int = -1) -> bytes:
        chunks = []
        while n != 0:
            if self._file is None:
                if not self.paths:
                    break
                self._file = open(self.paths.pop(0), "rb")  # noqa: SIM115 - closed below
            data = self._file.read(n if n > 0 else -1)
            if not data:
                self._file.close()
                self._file = None
                continue
            chunks.append(data)
            if n > 0:
                n -= len(data)
        return b"".join(chunks)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def unpack(manifest_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Verify the parts and restore the data directory `out_dir` (replacing an fp4stack build
    there, never anything else); returns its path."""
    path = find_manifest(manifest_path)
    manifest = verify(path)
    expected = {f["name"]: f for f in manifest["files"]}
    out = Path(out_dir).expanduser()
    build._check_out_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.unpacking-"))
    reader = _PartReader([path.parent / p["file"] for p in manifest["parts"]])
    try:
        with lzma.LZMAFile(reader) as xz, tarfile.open(fileobj=xz, mode="r|") as tar:
            for member in tar:
                if member.name not in expected or not member.isfile():
                    raise ValueError(f"{path}: the archive holds {member.name!r}, which its "
                                     "manifest does not list")
                src = tar.extractfile(member)
                assert src is not None
                with open(tmp / member.name, "wb") as dst:
                    shutil.copyfileobj(src, dst, MIB)
        for name, rec in expected.items():
            f = tmp / name
            if not f.is_file() or sha256_file(f) != rec["sha256"]:
                raise ValueError(f"{path}: {name} did not unpack to the recorded sha256")
            os.chmod(f, 0o644)
        os.chmod(tmp, 0o755)
        build._move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        reader.close()
    return out
