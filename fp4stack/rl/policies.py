"""Policies for RL: fp4stack's GPT (trained from scratch: an SFT warm-up on the task's format
first, so rewards are not all zero) or a Hugging Face causal LM (SmolLM2-135M offline, or a
directory), run by transformers or, with `as_gpt: true`, loaded into fp4stack's GPT (the model
the fast engine decodes); optionally upcycled from dense to MoE; and the SFT warm-up itself."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config_fields import suggest
from ..data.char_tokenizer import CharTokenizer
from ..data.tasks import Task
from ..models.gpt import GPT
from ..models.upcycle import moe_aux_loss, upcycle_gpt, upcycle_hf
from ..train.config import MODEL_PRESETS
from . import policy as lm

# GPTConfig.aux_loss_coef's default: HF's router_aux_loss_coef scale (see load_balance_loss).
HF_AUX_LOSS_COEF = 0.001


def build_policy(spec: dict[str, Any], upcycle: dict[str, Any] | None, seed: int,
                 max_len: int) -> tuple[nn.Module, lm.TokenizerLike]:
    """(model in fp32 on CPU, tokenizer) from a config's `policy` and `upcycle` entries."""
    spec = dict(spec)
    kind = spec.pop("kind")
    if kind == "gpt":
        tokenizer = CharTokenizer()
        preset = spec.pop("preset", "tiny-moe")
        if preset not in MODEL_PRESETS:
            raise ValueError(f"policy.preset {preset!r} is unknown"
                             f"{suggest(preset, MODEL_PRESETS)}; choose one of "
                             f"{sorted(MODEL_PRESETS)}")
        spec.setdefault("max_seq_len", max_len)
        torch.manual_seed(seed)
        try:
            model = GPT(MODEL_PRESETS[preset](vocab_size=tokenizer.vocab_size, **spec))
        except TypeError as e:
            raise ValueError(f"policy: {e}") from e
        if upcycle:
            model = upcycle_gpt(model, **upcycle, seed=seed)
        return model, tokenizer
    from ..models.hf import hf_directory, smollm2

    loaded = smollm2() if kind == "smollm2" else hf_directory(str(spec["path"]))
    if loaded.tokenizer is None:
        raise ValueError(f"policy {kind}: the model has no tokenizer; RL needs one")
    if spec.get("as_gpt"):
        return _as_gpt(loaded.model, kind, upcycle, seed), lm.HFTokenizer(loaded.tokenizer)
    # .to, not .float(): transformers refuses .float() on a model loaded from GGUF (SmolLM2),
    # although its weights are already dequantized to plain tensors.
    model = loaded.model.to(torch.float32)
    if upcycle:
        upcycle_hf(model, **upcycle, seed=seed)
    return model, lm.HFTokenizer(loaded.tokenizer)


def _as_gpt(hf: nn.Module, kind: str, upcycle: dict[str, Any] | None, seed: int) -> GPT:
    """The Hugging Face model's weights in fp4stack's GPT (fp32), upcycled if asked."""
    from ..models.hf_import import UnsupportedModel, gpt_from_hf

    try:
        # max_seq_len: the model's own limit, as the transformers policy has it.
        model = gpt_from_hf(hf, dtype=torch.float32)
    except UnsupportedModel as e:
        raise ValueError(f"policy {kind} with as_gpt: {e}; set as_gpt: false to run it through "
                         "transformers (engine: reference)") from e
    if upcycle:
        model = upcycle_gpt(model, **upcycle, seed=seed)
    return model


def encode_example(tokenizer: lm.TokenizerLike, prompt: str, completion: str | None = None
                   ) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids + EOS); the completion is empty when not given."""
    p = tokenizer.encode(prompt)
    c = [] if completion is None else tokenizer.encode(completion) + [tokenizer.eos_id]
    return p, c


def left_padded(rows: list[tuple[list[int], list[int]]], pad_id: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, mask, target) [B, W] of (prompt, completion) token lists, left-padded as the
    rollout engine lays prompts out; target marks the completions' tokens."""
    width = max(len(p) + len(c) for p, c in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    target = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, (p, c) in enumerate(rows):
        seq = p + c
        tokens[r, width - len(seq):] = torch.tensor(seq)
        mask[r, width - len(seq):] = True
        target[r, width - len(c):] = True
    return tokens, mask, target


def sft_warmup(model: nn.Module, tokenizer: lm.TokenizerLike, task: Task, *, steps: int,
               batch_size: int, lr: float, seed: int, device: torch.device,
               recipe: str = "bf16", log=print) -> list[float]:
    """Supervised warm-up on the task's reference completions (loss on completion tokens only,
    AdamW, cosine decay). Returns the loss of every step. recipe other than "bf16" (e.g.
    "qat-w", "nvfp4@forward"): the steps train a copy of `model` converted to that training
    recipe, whose weights (the same names, kept in full precision) are then `model`'s."""
    if steps == 0:
        return []
    if recipe != "bf16":
        import copy

        from ..convert import quantize_model

        trained = copy.deepcopy(model)
        quantize_model(trained, recipe)
        losses = sft_warmup(trained, tokenizer, task, steps=steps, batch_size=batch_size, lr=lr,
                            seed=seed, device=device, log=log)
        model.load_state_dict(trained.state_dict())
        model.eval()
        return losses
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=lr / 10)
    stream = task.train_examples(seed + 10_000)  # a seed range the RL prompts do not use
    rng = random.Random(seed)
    losses = []
    for i in range(steps):
        rows = [encode_example(tokenizer, e.prompt, task.completion(e))
                for e in (next(stream) for _ in range(batch_size))]
        rng.shuffle(rows)
        tokens, mask, target = (t.to(device) for t in left_padded(rows, tokenizer.pad_id))
        logits = lm.forward_logits(model, tokens, mask)[:, :-1].float()
        loss = F.cross_entropy(logits[target[:, 1:]], tokens[:, 1:][target[:, 1:]])
        aux = model.aux_loss if isinstance(model, GPT) else moe_aux_loss(model)
        if aux is not None:  # keep MoE routers balanced (an upcycled HF model's too)
            coef = model.config.aux_loss_coef if isinstance(model, GPT) else HF_AUX_LOSS_COEF
            loss = loss + coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if (i + 1) % max(1, steps // 5) == 0 or i == steps - 1:
            log(f"sft step {i + 1}/{steps} | loss {loss.item():.4f}")
    model.eval()
    return losses


def calibration_sequences(task: Task, tokenizer: lm.TokenizerLike, n: int, seed: int
                          ) -> list[list[int]]:
    """n task examples, prompt and reference completion as one token list each, from a seed
    range neither the SFT warm-up nor the RL prompts use: what static compensation channels
    are calibrated on."""
    stream = task.train_examples(seed + 20_000)
    return [p + c for p, c in (encode_example(tokenizer, e.prompt, task.completion(e))
                               for e in (next(stream) for _ in range(n)))]


def weights_digest(model: nn.Module) -> str:
    """A short SHA-256 of every tensor of the state dict (names, dtypes, shapes and bytes):
    runs that print the same digest start from bit-identical weights."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
