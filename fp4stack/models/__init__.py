"""fp4stack's own models, and Hugging Face causal LMs loaded offline (`hf`)."""

from .gpt import GPT, GPTConfig, KVCache
from .hf import LoadedModel, ModelUnavailable, hf_directory, smollm2

__all__ = ["GPT", "GPTConfig", "KVCache", "LoadedModel", "ModelUnavailable", "hf_directory",
           "smollm2"]
