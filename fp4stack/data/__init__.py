"""Pretraining data: corpora from real text, a BPE tokenizer, token shards.

`build_dataset` (or `fp4stack data build`) writes a data directory; `TokenShards` reads it.
"""

from .build import build_dataset
from .corpus import SOURCES, Document, resolve
from .shards import TokenShards, write_shard
from .tokenizer import EOT, load_tokenizer, train_tokenizer

__all__ = [
    "EOT", "SOURCES", "Document", "TokenShards", "build_dataset", "load_tokenizer", "resolve",
    "train_tokenizer", "write_shard",
]
