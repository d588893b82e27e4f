"""The docs' relative links: every linked file exists, every #anchor names a heading in it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), ROOT / "experiments/README.md"])
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.M)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings; a repeated heading gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_slugs_follow_githubs_rule():
    assert slug("The `medium` preset (356.6M parameters), 2026-12-03") == (
        "the-medium-preset-3566m-parameters-2026-12-03")
    assert slug("Four Over Six: 4/6 scales") == "four-over-six-46-scales"


def broken_links(doc: Path) -> list[str]:
    """A line per relative link of `doc` whose file or heading does not exist."""
    broken = []
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading with that anchor")
    return broken


def test_broken_links_are_found(tmp_path):
    (tmp_path / "b.md").write_text("# Results (H100, 2026-12-07)\n## Results (H100, 2026-12-07)\n")
    doc = tmp_path / "a.md"
    doc.write_text("[ok](b.md#results-h100-2026-12-07), [again](b.md#results-h100-2026-12-07-1),"
                   " [gone](c.md), [typo](b.md#results-h200-2026-12-07), [web](https://x.org/a)"
                   "\n```\n[in code](nowhere.md)\n```\n")
    assert broken_links(doc) == ["c.md: no such file",
                                 "b.md#results-h200-2026-12-07: no heading with that anchor"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    broken = broken_links(doc)
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)
