"""Pretraining data: corpora from real text, a BPE tokenizer, token shards."""

from .shards import TokenShards, write_shard

__all__ = ["TokenShards", "write_shard"]
