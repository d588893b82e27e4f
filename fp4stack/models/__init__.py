"""fp4stack's own models, Hugging Face causal LMs loaded offline (`hf`), and their weights read
into the GPT (`hf_import`)."""

from .gpt import GPT, GPTConfig, KVCache
from .hf import LoadedModel, ModelUnavailable, hf_directory, smollm2
from .hf_import import UnsupportedModel, gpt_from_hf, hf_state_dict

__all__ = ["GPT", "GPTConfig", "KVCache", "LoadedModel", "ModelUnavailable", "UnsupportedModel",
           "gpt_from_hf", "hf_directory", "hf_state_dict", "smollm2"]
