"""Token shards: a flat memmap of token ids per split, read as deterministic batches.

A data directory holds `train.bin` and `val.bin` (uint16 when the vocabulary fits, else uint32),
`tokenizer.json` and `manifest.json` (sources, sha256, token counts, dtype). Batches are a pure
function of (step, rank, world size, seed), so every recipe of a comparison sees the same tokens
in the same order, and a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from ..files import publish, temp_path


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def write_shard(path: str | os.PathLike, tokens: np.ndarray, vocab_size: int) -> None:
    """Write token ids to `path` atomically, as the smallest unsigned dtype that holds them."""
    path = Path(path)
    arr = np.asarray(tokens, dtype=token_dtype(vocab_size))
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(arr.tobytes())
        publish(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class TokenShards:
    """One split of a data directory, served as [batch, seq_len + 1] windows of token ids.

    Training batches: window starts drawn by a generator seeded from (seed, step), so batch
    `step` is the same in every run. With `micro_batch_size` m, the global batch is micro-batches
    of m consecutive rows and rank r of w takes micro-batches r, r + w, ...: a distributed run
    sees exactly the tokens of a single-process run with the same global batch, each
    micro-batch the same rows, so the quantizers of a micro-batch's forward (whose activation
    scales depend on all its rows) compute the same values on any number of ranks.
    Validation batches: fixed, contiguous, non-overlapping windows from the start of the split.
    """

    def __init__(self, directory: str | os.PathLike, split: str = "train") -> None:
        directory = Path(directory)
        manifest_path = directory / "manifest.json"
        if not manifest_path.exists():
            raise FileNotFoundError(f"{manifest_path} not found: build the data first "
                                    "(fp4stack data build)")
        self.manifest = json.loads(manifest_path.read_text())
        vocab = self.manifest.get("vocab_size") if isinstance(self.manifest, dict) else None
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise ValueError(f"{manifest_path}: vocab_size must be an integer >= 1, got "
                             f"{vocab!r}; rebuild the data (fp4stack data build)")
        self.vocab_size = vocab
        path = directory / f"{split}.bin"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found (splits: train, val)")
        dtype = np.dtype(token_dtype(vocab))
        if path.stat().st_size % dtype.itemsize:
            raise ValueError(f"{path}: {path.stat().st_size} bytes is not a whole number of "
                             f"{dtype} tokens (vocab_size {vocab} in {manifest_path}): the file "
                             "is truncated or the manifest is not its own; rebuild the data")
        self.tokens = np.memmap(path, dtype=dtype, mode="r")
        # Checked once here, so a mismatch is named, not an index error inside the embedding.
        top = int(self.tokens.max()) if len(self.tokens) else -1
        if top >= vocab:
            raise ValueError(f"{path} holds token id {top}, but {manifest_path} says vocab_size "
                             f"{vocab}: the manifest is not this data's; rebuild the data")

    def __len__(self) -> int:
        return len(self.tokens)

    def _windows(self, starts: np.ndarray, seq_len: int) -> torch.Tensor:
        rows = [np.asarray(self.tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts]
        return torch.from_numpy(np.stack(rows))

    def train_batch(self, step: int, batch_size: int, seq_len: int, *, seed: int = 0,
                    rank: int = 0, world_size: int = 1, micro_batch_size: int = 1
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) [batch_size // world_size, seq_len] of global batch `step`: this
        rank's micro-batches, in order."""
        if batch_size % (world_size * micro_batch_size):
            raise ValueError(f"batch_size {batch_size} is not divisible by world_size "
                             f"{world_size} x micro_batch_size {micro_batch_size}")
        hi = len(self.tokens) - seq_len - 1
        if hi <= 0:
            raise ValueError(f"split has {len(self.tokens)} tokens, fewer than seq_len + 1 = "
                             f"{seq_len + 1}")
        rng = np.random.default_rng([seed, step])
        starts = rng.integers(0, hi, size=batch_size).reshape(-1, micro_batch_size)
        starts = starts[rank::world_size].reshape(-1)
        w = self._windows(starts, seq_len)
        return w[:, :-1], w[:, 1:]

    def val_batches(self, batch_size: int, seq_len: int, max_batches: int):
        """The same fixed validation windows for every run: up to `max_batches` batches."""
        n = min((len(self.tokens) - 1) // seq_len, batch_size * max_batches)
        if n == 0:
            raise ValueError(f"validation split too small for seq_len {seq_len}")
        starts = np.arange(n) * seq_len
        for i in range(0, n, batch_size):
            w = self._windows(starts[i : i + batch_size], seq_len)
            yield w[:, :-1], w[:, 1:]
