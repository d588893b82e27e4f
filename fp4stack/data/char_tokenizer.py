"""A character-level tokenizer for tiny policies trained from scratch on arithmetic.

Ids 0, 1, 2 are pad, bos and eos; the alphabet's characters follow in order. The default
alphabet covers every prompt and answer of the arithmetic tasks (negative answers included).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_ALPHABET = "0123456789+-*=() "
SPECIALS = ("<pad>", "<bos>", "<eos>")


class CharTokenizer:
    """Maps each character of `alphabet` to one id; see the module docstring for the layout."""

    pad_id = 0
    bos_id = 1
    eos_id = 2

    def __init__(self, alphabet: str = DEFAULT_ALPHABET):
        if not isinstance(alphabet, str) or not alphabet:
            raise ValueError(f"alphabet must be a non-empty str, got {alphabet!r}")
        repeated = sorted({ch for ch in alphabet if alphabet.count(ch) > 1})
        if repeated:
            raise ValueError(f"alphabet repeats characters {repeated}")
        self.alphabet = alphabet
        self._ids = {ch: i + len(SPECIALS) for i, ch in enumerate(alphabet)}
        self.vocab_size = len(SPECIALS) + len(alphabet)

    def encode(self, text: str) -> list[int]:
        """The ids of `text`'s characters, with no special tokens added."""
        try:
            return [self._ids[ch] for ch in text]
        except KeyError as e:
            raise ValueError(
                f"character {e.args[0]!r} is not in the tokenizer's alphabet {self.alphabet!r}"
            ) from None

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """The text of `ids` up to the first eos, skipping pad and bos."""
        if hasattr(ids, "tolist"):  # a tensor or array
            ids = ids.tolist()
        chars = []
        for i in ids:
            if i == self.eos_id:
                break
            if i in (self.pad_id, self.bos_id):
                continue
            if not 0 <= i < self.vocab_size:
                # A policy whose output layer is wider than vocab_size must mask the extra logits.
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            chars.append(self.alphabet[i - len(SPECIALS)])
        return "".join(chars)

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokenizer as JSON."""
        spec = {"type": "char", "specials": list(SPECIALS), "alphabet": self.alphabet}
        Path(path).write_text(json.dumps(spec, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> CharTokenizer:
        """Read a tokenizer written by `save`."""
        spec = json.loads(Path(path).read_text())
        if spec.get("type") != "char" or spec.get("specials") != list(SPECIALS):
            raise ValueError(f"{path} does not hold a CharTokenizer")
        return cls(spec["alphabet"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other.alphabet == self.alphabet

    def __hash__(self) -> int:
        return hash(self.alphabet)

    def __repr__(self) -> str:
        return f"CharTokenizer({self.alphabet!r})"
