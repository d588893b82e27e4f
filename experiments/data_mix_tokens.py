"""Per-source size of a built corpus before and after deduplication, in MB and in tokens.

Re-reads the sources a data directory was built from (from the download cache), deduplicates
them as the build did, and counts tokens with the directory's own tokenizer (each document
followed by its end-of-text token). Prints a Markdown table; --json writes the numbers.

    python experiments/data_mix_tokens.py runs/data/docs --json experiments/results/docs_mix.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fp4stack.data import corpus, dedup, load_tokenizer
from fp4stack.data.build import default_cache_dir


def token_counts(tok, texts: list[str], batch: int = 512) -> list[int]:
    """Tokens of each text, its end-of-text token included."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    counts: list[int] = []
    for i in range(0, len(texts), batch):
        counts += [len(e.ids) + 1 for e in encode(texts[i : i + batch],
                                                   add_special_tokens=False)]
    return counts


def measure(data_dir: Path, cache: Path) -> list[dict]:
    manifest = json.loads((data_dir / "manifest.json").read_text())
    build = manifest["build"]
    tok = load_tokenizer(data_dir)
    docs: list[tuple[int, str]] = []
    for i, name in enumerate(build["sources"]):
        src = corpus.resolve(name)
        docs += [(i, d.text) for d in src.read(src.fetch(cache))]
    texts = [t for _, t in docs]
    before = token_counts(tok, texts)
    after = list(before)
    if build.get("deduplicate", False):
        result = dedup.deduplicate(texts, seed=build["seed"])
        changed = [k for k, t in enumerate(result.texts) if t != texts[k]]
        recount = token_counts(tok, [result.texts[k] or "" for k in changed])
        for k, n in zip(changed, recount, strict=True):
            after[k] = n if result.texts[k] is not None else 0
        kept = list(result.texts)
    else:
        kept = list(texts)
    rows = []
    for i, name in enumerate(build["sources"]):
        idx = [k for k, (j, _) in enumerate(docs) if j == i]
        rows.append({
            "source": name, "license": corpus.resolve(name).license,
            "documents": len(idx), "documents_after": sum(kept[k] is not None for k in idx),
            "mb": sum(len(texts[k].encode()) for k in idx) / 1e6,
            "mb_after": sum(len(kept[k].encode()) for k in idx if kept[k] is not None) / 1e6,
            "tokens": sum(before[k] for k in idx), "tokens_after": sum(after[k] for k in idx),
        })
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| source | licence | docs | MB | MB dedup | tokens (M) | tokens dedup (M) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['source']} | {r['license']} | {r['documents_after']:,} | "
                     f"{r['mb']:.1f} | {r['mb_after']:.1f} | {r['tokens'] / 1e6:.2f} | "
                     f"{r['tokens_after'] / 1e6:.2f} |")
    tot = {k: sum(r[k] for r in rows) for k in ("documents_after", "mb", "mb_after", "tokens",
                                                 "tokens_after")}
    lines.append(f"| **total** | | {tot['documents_after']:,} | {tot['mb']:.1f} | "
                 f"{tot['mb_after']:.1f} | {tot['tokens'] / 1e6:.2f} | "
                 f"{tot['tokens_after'] / 1e6:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", type=Path, help="a data directory (fp4stack data build --out)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="download cache (default ~/.cache/fp4stack/sources)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args()
    rows = measure(args.data, args.cache_dir or default_cache_dir())
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
