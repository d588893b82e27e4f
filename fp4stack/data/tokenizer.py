"""A byte-level BPE tokenizer (GPT-2 style), trained with Hugging Face `tokenizers`.

Byte-level means every string encodes, with no unknown token, and decodes back to exactly the
same string: the 256 byte symbols are always in the vocabulary, and there is no normalizer.
Id 0 is the end-of-text token that separates documents in the token stream.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

EOT = "<|endoftext|>"


def _tokenizers():
    try:
        import tokenizers
    except ImportError as e:
        raise ImportError("building data needs `tokenizers`: pip install 'fp4stack[data]'") from e
    return tokenizers


def train_tokenizer(texts: Sequence[str], vocab_size: int, min_frequency: int = 2):
    """A byte-level BPE `tokenizers.Tokenizer` with `vocab_size` entries (fewer when the text
    has too few pairs seen `min_frequency` times), EOT first."""
    tk = _tokenizers()
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be >= 257 (256 bytes and {EOT}), got {vocab_size}")
    tok = tk.Tokenizer(tk.models.BPE())
    # No prefix space: it would add a space to every document and break the round trip.
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOT],
        # All 256 bytes, even those absent from the training text: nothing is ever unknown.
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.token_to_id(EOT) == 0
    return tok


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer of a data directory (or a tokenizer.json file)."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: build the data first (fp4stack data build)")
    return _tokenizers().Tokenizer.from_file(str(path))


def encode_documents(tok, texts: Sequence[str], batch_size: int = 1024,
                     progress=None) -> Iterator[np.ndarray]:
    """Token ids of `texts`, each document followed by EOT, one int64 array per batch.

    Batches are encoded in parallel by `tokenizers` (encode_batch_fast skips the offsets, which
    are not needed here); `progress(n)` is called after each batch with its document count.
    """
    eot = tok.token_to_id(EOT)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast: tokenizers >= 0.21
    for i in range(0, len(texts), batch_size):
        batch = texts[i : i + batch_size]
        ids = [e.ids for e in encode(list(batch), add_special_tokens=False)]
        out = np.empty(sum(map(len, ids)) + len(ids), dtype=np.int64)
        pos = 0
        for doc in ids:
            out[pos : pos + len(doc)] = doc
            out[pos + len(doc)] = eot
            pos += len(doc) + 1
        if progress is not None:
            progress(len(batch))
        yield out
