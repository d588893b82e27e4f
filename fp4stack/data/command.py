"""`fp4stack data build|sources|pack|unpack` (registered in fp4stack/cli.py).

    fp4stack data build --sources wikipedia --vocab-size 4096 --max-chars 3M --out runs/data/tiny
    fp4stack data sources
    fp4stack data pack runs/data/docs --out runs/pack/docs --parts-mib 60
    fp4stack data unpack runs/pack/docs --out runs/data/docs
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
    """The actions of `fp4stack data` (build, sources, pack, unpack) and their options."""
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    b = sub.add_parser("build", help="build a data directory (train.bin, val.bin, tokenizer)",
                       description="Fetch corpora (cached), split them by document, train a "
                       "byte-level BPE tokenizer on the train split and write token shards. A "
                       "second identical build returns at once.")
    b.add_argument("--sources", nargs="+", default=["wikipedia"], metavar="SRC",
                   help="wikipedia (default), a named source or mix (see `fp4stack data "
                   "sources`: docs-mix is all of them), or .txt/.jsonl files or directories; "
                   "several separated by spaces or commas")
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
    b.add_argument("--no-dedup", dest="deduplicate", action="store_false",
                   help="keep near-duplicate documents and repeated paragraphs")
    b.add_argument("--force", action="store_true", help="rebuild even if up to date")
    b.add_argument("--quiet", action="store_true", help="no progress output")

    sub.add_parser("sources", help="list the named sources and mixes with their licences",
                   description="The named corpus sources (description, licence) and mixes.")

    pk = sub.add_parser("pack", help="compress a data directory into parts of bounded size",
                        description="Write the data directory as an xz-compressed tar stream cut "
                        "into numbered parts of at most --parts-mib MiB, with a NAME.pack.json "
                        "manifest (sha256 of every part and file), for machines reached only by "
                        "small transfers.")
    pk.add_argument("data", help="the data directory (fp4stack data build --out)")
    pk.add_argument("--out", required=True, help="folder for the parts and the manifest")
    pk.add_argument("--parts-mib", type=float, default=60,
                    help="largest part in MiB (default 60)")
    pk.add_argument("--name", default=None, help="pack name (default: the data folder's name)")
    pk.add_argument("--preset", type=int, default=6, choices=range(10), metavar="0-9",
                    help="xz compression level (default 6)")

    up = sub.add_parser("unpack", help="verify the parts of a pack and restore the directory",
                        description="Check every part's size and sha256, then restore the data "
                        "directory and check every file's sha256.")
    up.add_argument("pack", help="the NAME.pack.json file, or the folder holding it and the "
                    "parts")
    up.add_argument("--out", required=True, help="the data directory to write")
    up.add_argument("--check", action="store_true",
                    help="only verify the parts; write nothing")


def run(args: argparse.Namespace) -> int:
    """Run the action; 2 on a bad source, option or pack."""
    action = {"build": _build, "sources": _sources, "pack": _pack, "unpack": _unpack}
    try:
        return action[args.data_command](args)
    except (ValueError, RuntimeError, OSError, ImportError) as e:
        print(f"fp4stack data: error: {e}", file=sys.stderr)
        return 2


def _sources(args: argparse.Namespace) -> int:
    from .corpus import MIXES, SOURCES

    for name, src in SOURCES.items():
        print(f"{name:24s} {src.license:40s} {src.description}")
    for name, names in MIXES.items():
        print(f"{name:24s} mix of {len(names)}: {', '.join(names)}")
    return 0


def _pack(args: argparse.Namespace) -> int:
    from .pack import pack

    path = pack(args.data, args.out, parts_mib=args.parts_mib, name=args.name,
                preset=args.preset)
    manifest = json.loads(path.read_text())
    print(f"{path}: {len(manifest['parts'])} part(s), {manifest['bytes']:,} bytes")
    return 0


def _unpack(args: argparse.Namespace) -> int:
    from .pack import unpack, verify

    if args.check:
        manifest = verify(args.pack)
        print(f"{args.pack}: {len(manifest['parts'])} part(s) intact")
        return 0
    print(f"{unpack(args.pack, args.out)}: unpacked and verified")
    return 0


def _build(args: argparse.Namespace) -> int:
    from .build import build_dataset

    sources = [s for arg in args.sources for s in arg.split(",") if s]
    out = build_dataset(
        args.out, sources, vocab_size=args.vocab_size, val_fraction=args.val_fraction,
        max_chars=args.max_chars, seed=args.seed, cache_dir=args.cache_dir,
        min_val_tokens=args.min_val_tokens, deduplicate=args.deduplicate, force=args.force,
        verbose=not args.quiet,
    )
    manifest = json.loads((out / "manifest.json").read_text())
    splits = manifest["splits"]
    print(f"{out}: train {splits['train']['tokens']:,} tokens, val {splits['val']['tokens']:,} "
          f"tokens, vocab {manifest['vocab_size']:,} ({manifest['dtype']})")
    return 0
