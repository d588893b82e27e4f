"""Named corpus sources from Debian documentation packages and dictionaries: how a package of
the catalog (debian_catalog.DEBIAN_DOCS) is read.

Each source is one Debian package, read without installing it: the files under `prefix` whose
names end in one of `suffixes`, minus those matching `exclude` (indexes, search pages, source-code
views, redirects, other languages), converted from their markup to plain text (fp4stack.data.
markup). Pages with fewer than MIN_WORDS words after conversion (stubs, redirects, tables of
contents) are left out. A dictd dictionary has no pages: its entries, in the database's order,
are grouped into documents of about DICT_DOC_CHARS characters.

The licence of each source is its Debian copyright file's (usr/share/doc/PACKAGE/copyright).
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Callable, Iterator
from pathlib import Path

from . import markup
from .corpus import Document, Source, _deb_members, _debian_fetch, _document
from .debian_catalog import DEBIAN_DOCS, DebianDoc

MIN_WORDS = 30
DICT_DOC_CHARS = 16_000

_CONVERTERS: dict[str, Callable[[str], str]] = {
    "html": markup.html_to_text,
    "man": markup.roff_to_text,
    "pod": markup.pod_to_text,
    "text": lambda s: s,
}
# Pages that are lists of links, not text, in the generators these packages use.
_INDEX_PAGES = r"(^|/)(genindex|py-modindex|search|searchindex|doc-index|index-all)[^/]*$"


def _skip(spec: DebianDoc) -> re.Pattern:
    return re.compile("|".join(p for p in (_INDEX_PAGES, spec.exclude) if p))


def selects(spec: DebianDoc, path: str) -> bool:
    """Whether a page of the package, at `path` below spec.prefix, is read."""
    return path.endswith(spec.suffixes) and not _skip(spec).search(path)


def _read_pages(name: str, spec: DebianDoc) -> Callable[[list[Path]], Iterator[Document]]:
    convert = _CONVERTERS[spec.markup]
    skip = _skip(spec)

    def read(files: list[Path]) -> Iterator[Document]:
        pages = {}
        for path, raw in _deb_members(files[0], spec.prefix, spec.suffixes):
            if skip.search(path):
                continue
            if path.endswith(".gz"):
                raw, path = gzip.decompress(raw), path[:-3]
            pages[path] = raw
        for path in sorted(pages):
            text = convert(pages[path].decode("utf-8", errors="replace"))
            if len(text.split()) >= MIN_WORDS:
                doc = _document(name, path, text)
                if doc:
                    yield doc

    return read


def _read_dictd(name: str, spec: DebianDoc) -> Callable[[list[Path]], Iterator[Document]]:
    def read(files: list[Path]) -> Iterator[Document]:
        members = dict(_deb_members(files[0], spec.prefix, (".index", ".dict.dz", ".dict")))
        for index_name in sorted(m for m in members if m.endswith(".index")):
            base = index_name[: -len(".index")]
            data = members.get(base + ".dict.dz")
            data = gzip.decompress(data) if data is not None else members.get(base + ".dict")
            if data is None:
                raise RuntimeError(f"{files[0].name}: {index_name} has no .dict(.dz) beside it")
            entries = markup.dictd_entries(members[index_name].decode("utf-8", "replace"), data)
            yield from _group_entries(name, base, entries)

    return read


def _group_entries(name: str, base: str, entries: list[tuple[str, str]]) -> Iterator[Document]:
    """Consecutive entries joined into documents of about DICT_DOC_CHARS characters, each named
    after its first headword."""
    group: list[str] = []
    first, size = "", 0
    for word, text in [*entries, ("", "")]:
        if group and (size >= DICT_DOC_CHARS or not text):
            doc = _document(name, f"{base}:{first}", "\n\n".join(group))
            if doc:
                yield doc
            group, size = [], 0
        if text:
            first = first if group else word
            group.append(text)
            size += len(text) + 2


def _source(name: str, spec: DebianDoc) -> Source:
    read = _read_dictd(name, spec) if spec.markup == "dictd" else _read_pages(name, spec)
    return Source(name=name, description=f"{spec.description}, from the Debian package "
                  f"{spec.package}", license=spec.license, fetch=_debian_fetch(spec.package),
                  read=read)


def sources() -> dict[str, Source]:
    return {name: _source(name, spec) for name, spec in DEBIAN_DOCS.items()}


__all__ = ["DEBIAN_DOCS", "DebianDoc", "selects", "sources"]
