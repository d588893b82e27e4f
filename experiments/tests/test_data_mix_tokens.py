"""experiments/data_mix_tokens.py: its per-source counts after deduplication add up to the
tokens the build wrote, and its counts before deduplication to a build without it."""

from __future__ import annotations

import json
from pathlib import Path

import data_mix_tokens

from fp4stack.data import build_dataset

ROOT = Path(__file__).resolve().parents[2]


def test_counts_match_the_builds(tmp_path):
    paragraphs = [p.strip() for p in (ROOT / "README.md").read_text().split("\n\n")
                  if len(p.strip()) > 150]
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    for i, p in enumerate(paragraphs[:20]):
        (first / f"{i}.txt").write_text(p)
    (second / "copy.txt").write_text(paragraphs[0])  # a near duplicate: dropped
    (second / "mixed.txt").write_text(paragraphs[1] + "\n\nSomething new in this copy.")
    (second / "new.txt").write_text(paragraphs[25] if len(paragraphs) > 25 else "New text.")
    kw = {"vocab_size": 300, "min_val_tokens": 0, "val_fraction": 0.2, "verbose": False}
    sources = [str(first), str(second)]
    built = build_dataset(tmp_path / "dedup", sources, **kw)
    rows = data_mix_tokens.measure(built, tmp_path / "cache")
    m = json.loads((built / "manifest.json").read_text())
    total = sum(s["tokens"] for s in m["splits"].values())
    assert sum(r["tokens_after"] for r in rows) == total
    assert rows[0]["tokens_after"] == rows[0]["tokens"]
    assert rows[1]["tokens_after"] < rows[1]["tokens"] and rows[1]["documents_after"] == 2
    assert rows[1]["mb_after"] < rows[1]["mb"]
    # Before deduplication: what a build without it writes, with the same tokenizer.
    raw = build_dataset(tmp_path / "raw", sources, deduplicate=False, **kw)
    raw_rows = data_mix_tokens.measure(raw, tmp_path / "cache")
    m_raw = json.loads((raw / "manifest.json").read_text())
    assert sum(r["tokens"] for r in raw_rows) == sum(s["tokens"] for s in m_raw["splits"].values())
    assert "| **total** |" in data_mix_tokens.table(rows)
