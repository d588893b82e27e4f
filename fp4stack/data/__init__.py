"""Pretraining data: corpora from real text, a BPE tokenizer, token shards.

`build_dataset` (or `fp4stack data build`) writes a data directory; `TokenShards` reads it.
"""

from . import corpus
from .build import build_dataset
from .corpus import SOURCES, Document, resolve
from .debian_docs import DEBIAN_DOCS
from .debian_docs import sources as _debian_doc_sources
from .shards import TokenShards, write_shard
from .tokenizer import EOT, load_tokenizer, train_tokenizer

# The Debian documentation sources and the mix of all sources (prose first: deduplication keeps
# the first copy). Registered here, not in corpus, which debian_docs imports.
corpus.SOURCES.update(_debian_doc_sources())
corpus.MIXES["docs-mix"] = ("wikipedia", "linux-docs", "python-docs", *DEBIAN_DOCS)

__all__ = [
    "EOT", "SOURCES", "Document", "TokenShards", "build_dataset", "load_tokenizer", "resolve",
    "train_tokenizer", "write_shard",
]
