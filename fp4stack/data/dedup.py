"""Deduplication of a corpus: near-duplicate documents (MinHash), then repeated paragraphs.

Documentation packages repeat themselves: the same page in two manuals, a trait method copied
into every type that implements it, a footer on every page. Two passes, in corpus order (the
first occurrence is kept, so the sources listed first win):

1. Near-duplicate documents: a MinHash signature per document over its word 5-shingles; documents
   that share a band of the signature are compared, and a document whose estimated Jaccard
   similarity to an earlier kept one reaches `threshold` is dropped whole.
2. Repeated paragraphs: a paragraph (text between blank lines) whose normalized form (lower case,
   whitespace collapsed) was seen before is removed, when it is at least `min_paragraph_chars`
   long (short ones are headings like "Parameters" that carry structure, not content). A document
   left empty is dropped.

Everything is deterministic: the hashes are fixed functions of the text and `seed`.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SHINGLE = 5
NUM_PERM = 64
BANDS = 16  # of NUM_PERM // BANDS rows: pairs above Jaccard ~0.6 almost always meet in a band
THRESHOLD = 0.8
MIN_PARAGRAPH_CHARS = 40
MAX_COMPARED = 32  # kept documents compared per band bucket: bounds the work on huge clusters
_PARAGRAPH_BREAK = re.compile(r"(\n[ \t]*\n\s*)")


@dataclass
class DedupResult:
    texts: list[str | None]  # each document after deduplication, None when it was dropped
    near_duplicate_of: list[int]  # index of the kept document it duplicates, else -1
    paragraphs_removed: list[int]  # repeated paragraphs removed from each document
    chars_removed: list[int]  # characters removed from each document (all of a dropped one)


class MinHasher:
    """MinHash signatures [NUM_PERM] uint32 of word shingles, with hashes fixed by `seed`."""

    def __init__(self, seed: int = 0, num_perm: int = NUM_PERM, shingle: int = SHINGLE) -> None:
        rng = np.random.default_rng([seed, 0x6D696E68])
        # Multiply-shift hashing: (a * x + b) mod 2**64, top 32 bits; a odd.
        self.a = rng.integers(0, 2**63, size=(num_perm, 1), dtype=np.uint64) * 2 + 1
        self.b = rng.integers(0, 2**63, size=(num_perm, 1), dtype=np.uint64)
        self.mult = rng.integers(0, 2**63, size=shingle, dtype=np.uint64) * 2 + 1
        self.shingle = shingle
        self._words: dict[str, int] = {}

    def shingles(self, text: str) -> np.ndarray:
        """The distinct shingle hashes (uint64) of a text's lower-cased words."""
        words = text.lower().split()
        if not words:
            return np.zeros(0, dtype=np.uint64)
        cache = self._words
        for w in set(words).difference(cache):
            cache[w] = zlib.crc32(w.encode("utf-8", "surrogatepass"))
        h = np.fromiter(map(cache.__getitem__, words), dtype=np.uint64, count=len(words))
        k = min(self.shingle, len(h))
        n = len(h) - k + 1
        s = np.zeros(n, dtype=np.uint64)
        for j in range(k):  # wraps modulo 2**64, as intended
            s += h[j : j + n] * self.mult[j]
        return np.unique(s)

    def signature(self, text: str) -> np.ndarray | None:
        """The MinHash signature of `text`, or None when it has no words."""
        s = self.shingles(text)
        if s.size == 0:
            return None
        sig = np.full(len(self.a), np.iinfo(np.uint64).max, dtype=np.uint64)
        for i in range(0, s.size, 1 << 14):  # bounded memory on very long documents
            chunk = s[None, i : i + (1 << 14)]
            np.minimum(sig, (self.a * chunk + self.b).min(axis=1), out=sig)
        return (sig >> np.uint64(32)).astype(np.uint32)


def estimated_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(a == b))


def near_duplicates(texts: Sequence[str], *, threshold: float = THRESHOLD, seed: int = 0,
                    bands: int = BANDS) -> list[int]:
    """For each text, the index of an earlier kept text it nearly duplicates, else -1."""
    hasher = MinHasher(seed)
    rows = NUM_PERM // bands
    buckets: list[dict[bytes, list[int]]] = [{} for _ in range(bands)]
    sigs: list[np.ndarray | None] = []
    dup_of = [-1] * len(texts)
    for i, text in enumerate(texts):
        sig = hasher.signature(text)
        sigs.append(sig)
        if sig is None:
            continue
        keys = [sig[b * rows : (b + 1) * rows].tobytes() for b in range(bands)]
        found = -1
        for b, key in enumerate(keys):
            for j in buckets[b].get(key, ())[:MAX_COMPARED]:
                if estimated_jaccard(sig, sigs[j]) >= threshold:
                    found = j
                    break
            if found >= 0:
                break
        if found >= 0:
            dup_of[i] = found
            sigs[i] = None  # a dropped document is never compared again
            continue
        for b, key in enumerate(keys):
            buckets[b].setdefault(key, []).append(i)
    return dup_of


def normalize_paragraph(paragraph: str) -> str:
    return " ".join(paragraph.lower().split())


def remove_repeated_paragraphs(text: str, seen: set[bytes],
                               min_chars: int = MIN_PARAGRAPH_CHARS) -> tuple[str, int]:
    """`text` without the paragraphs already in `seen` (which it extends), and their count.

    Paragraph separators are kept as they were, so a text with nothing removed is unchanged.
    """
    pieces = _PARAGRAPH_BREAK.split(text)  # paragraph, separator, paragraph, ...
    kept: list[str] = []
    removed = 0
    for i in range(0, len(pieces), 2):
        para = pieces[i]
        norm = normalize_paragraph(para)
        if len(norm) >= min_chars:
            key = hashlib.blake2b(norm.encode("utf-8", "surrogatepass"), digest_size=12).digest()
            if key in seen:
                removed += 1
                continue
            seen.add(key)
        if kept:
            kept.append(pieces[i - 1])
        kept.append(para)
    return ("".join(kept).strip() if removed else text), removed


def deduplicate(texts: Sequence[str], *, threshold: float = THRESHOLD,
                min_paragraph_chars: int = MIN_PARAGRAPH_CHARS, seed: int = 0) -> DedupResult:
    """Both passes over `texts`, in order: near-duplicate documents, then repeated paragraphs."""
    dup_of = near_duplicates(texts, threshold=threshold, seed=seed)
    seen: set[bytes] = set()
    out: list[str | None] = []
    n_removed, chars_removed = [], []
    for text, dup in zip(texts, dup_of, strict=True):
        if dup >= 0:
            out.append(None)
            n_removed.append(0)
            chars_removed.append(len(text))
            continue
        new, removed = remove_repeated_paragraphs(text, seen, min_paragraph_chars)
        out.append(new if new else None)
        n_removed.append(removed)
        chars_removed.append(len(text) - len(new))
    return DedupResult(out, dup_of, n_removed, chars_removed)
