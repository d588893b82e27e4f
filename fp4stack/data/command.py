"""`fp4stack data build` (registered in fp4stack/cli.py).

    fp4stack data build --sources wikipedia --vocab-size 4096 --max-chars 3M --out runs/data/tiny
"""

from __future__ import annotations

import argparse
import json
import sys

from ..config_fields import positive_int


def _max_chars(text: str) -> int:
    """3000000, 3_000_000, 3M or 500k."""
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}.get(text[-1:].lower(), 1)
    try:
        value = int(float(text[:-1] if scale > 1 else text.replace("_", "")) * scale)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a character count like 3000000 or 3M, "
                                         f"got {text!r}") from e
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The actions of `fp4stack data` (build) and their options."""
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    b = sub.add_parser("build", help="build a data directory (train.bin, val.bin, tokenizer)",
                       description="Fetch corpora (cached), split them by document, train a "
                       "byte-level BPE tokenizer on the train split and write token shards. A "
                       "second identical build returns at once.")
    b.add_argument("--sources", nargs="+", default=["wikipedia"], metavar="SRC",
                   help="wikipedia (default), linux-docs, python-docs, or .txt/.jsonl files or "
                   "directories; several separated by spaces or commas")
    b.add_argument("--out", required=True,
                   help="the data directory to write; an existing one is replaced only if it "
                   "holds an fp4stack build and nothing else")
    b.add_argument("--vocab-size", type=positive_int, default=8192,
                   help="BPE vocabulary size (default 8192)")
    b.add_argument("--val-fraction", type=float, default=0.01,
                   help="share of characters held out for validation (default 0.01)")
    b.add_argument("--min-val-tokens", type=int, default=16384,
                   help="about this many validation tokens at least (default 16384)")
    b.add_argument("--max-chars", type=_max_chars, default=None,
                   help="use a random subset of at most this many characters (e.g. 3M)")
    b.add_argument("--seed", type=int, default=0, help="document shuffle seed (default 0)")
    b.add_argument("--cache-dir", default=None,
                   help="download cache (default ~/.cache/fp4stack/sources)")
    b.add_argument("--force", action="store_true", help="rebuild even if up to date")
    b.add_argument("--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    """Build the data directory and print its token counts; 2 on a bad source or option."""
    from .build import build_dataset

    sources = [s for arg in args.sources for s in arg.split(",") if s]
    try:
        out = build_dataset(
            args.out, sources, vocab_size=args.vocab_size, val_fraction=args.val_fraction,
            max_chars=args.max_chars, seed=args.seed, cache_dir=args.cache_dir,
            min_val_tokens=args.min_val_tokens, force=args.force, verbose=not args.quiet,
        )
    except (ValueError, RuntimeError, OSError, ImportError) as e:
        print(f"fp4stack data: error: {e}", file=sys.stderr)
        return 2
    manifest = json.loads((out / "manifest.json").read_text())
    splits = manifest["splits"]
    print(f"{out}: train {splits['train']['tokens']:,} tokens, val {splits['val']['tokens']:,} "
          f"tokens, vocab {manifest['vocab_size']:,} ({manifest['dtype']})")
    return 0
