"""One interface over the causal LMs RL drives: fp4stack's GPT and Hugging Face models.

Both take left-padded batches: prompts of different lengths are right-aligned, `mask` [B, L] marks
real tokens, and each row's positions count only its real tokens. `step` runs new columns against
a KV cache (rollout decoding); `token_logprobs` scores whole sequences (trainer, engine scoring).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Protocol

import torch.nn.functional as F
from torch import Tensor, nn

from ..models.gpt import GPT, KVCache
from .logprob_head import target_logprobs


class TokenizerLike(Protocol):
    """What RL needs of a tokenizer (CharTokenizer has it; `HFTokenizer` wraps transformers')."""

    pad_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids) -> str: ...


class HFTokenizer:
    """A transformers tokenizer seen through `TokenizerLike` (no special tokens added)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id: RL needs one to stop sequences")
        self.eos_id = int(tokenizer.eos_token_id)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.vocab_size = len(tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[:ids.index(self.eos_id)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def positions(mask: Tensor) -> Tensor:
    """Position of every column: the number of real tokens before it in its row (pads: 0)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def new_cache(model: nn.Module, batch: int, max_len: int) -> Any:
    """An empty KV cache for `model` holding `max_len` positions."""
    if isinstance(model, GPT):
        return [KVCache(max_len) for _ in model.model.layers]
    from transformers import DynamicCache

    # The config gives each layer its cache type (sliding-window layers keep only their window).
    return DynamicCache(config=model.config)


@functools.cache
def _cache_argument(model_type: type) -> str:
    # transformers renamed forward's `past_key_values` to `cache` (the old name is deprecated).
    params = inspect.signature(model_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def step(model: nn.Module, idx: Tensor, mask: Tensor, cache: Any) -> Tensor:
    """Logits [B, S, V] for the new columns idx [B, S]; mask [B, L] covers cached + new columns."""
    if isinstance(model, GPT):
        logits, _ = model(idx, kv_caches=cache, attention_mask=mask)
        return logits
    pos = positions(mask)[:, -idx.shape[1]:]
    out = model(input_ids=idx, attention_mask=mask.long(), position_ids=pos, use_cache=True,
                **{_cache_argument(type(model)): cache})
    return out.logits


def forward_logits(model: nn.Module, tokens: Tensor, mask: Tensor) -> Tensor:
    """Logits [B, L, V] of a whole left-padded batch (no cache); `model` may be a policy
    through torch.compile."""
    if isinstance(getattr(model, "_orig_mod", model), GPT):
        logits, _ = model(tokens, attention_mask=mask)
        return logits
    return model(input_ids=tokens, attention_mask=mask.long(), position_ids=positions(mask),
                 use_cache=False).logits


def token_logprobs(model: nn.Module, tokens: Tensor, mask: Tensor, temperature: float = 1.0,
                   entropy: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """log p(tokens[:, t] | tokens[:, :t]) at every real column with a real column before it,
    [B, L] float32; every other column (pads, each row's first token) holds 0, so a padded row
    scores as the sequence alone. The sampling temperature divides the logits, as the engine
    sampled. entropy=True also returns the (detached) entropy of each column's distribution.
    The log-softmax runs a chunk of rows at a time (rl.logprob_head): no float32 [B, L, V]
    tensor is held, and the values are the plain computation's."""
    logits = forward_logits(model, tokens, mask)
    # Column t scores token t + 1; the last column's target is a dummy, dropped below (scoring
    # the whole logits tensor saves copying a strided slice of it).
    out = target_logprobs(logits, F.pad(tokens[:, 1:], (0, 1)), temperature, entropy=entropy)
    lp, ent = out if entropy else (out, None)
    mask = mask.bool()
    scored = F.pad(mask[:, 1:] & mask[:, :-1], (1, 0))  # a first token has no context to score
    lp = F.pad(lp[:, :-1], (1, 0)).masked_fill(~scored, 0.0)
    if not entropy:
        return lp
    return lp, F.pad(ent[:, :-1], (1, 0)).masked_fill(~scored, 0.0)
