"""One GRPO update of the trainer: the gradients of a step's rollouts in micro-batches (under
the trainer's autocast, with routing replay and the rollout correction), then one optimizer step.
A micro-batch that runs out of device memory halves the size and starts the gradients again.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from ..nn.moe import replay_routing
from ..nn.operands import weight_operands_once
from . import policy as lm
from .config import RLConfig
from .grpo_loss import grpo_loss, rollout_correction
from .rollout import Rollout


def _slice_routing(routing: dict | None, rows: slice) -> dict | None:
    return None if routing is None else {k: v[rows] for k, v in routing.items()}


def trainer_autocast(cfg: RLConfig, device: torch.device):
    """The trainer's compute precision: bfloat16 autocast for trainer_dtype "bfloat16" (fp32
    master weights and optimizer either way; the log-probs and the loss in float32), else
    nothing."""
    if cfg.trainer_dtype == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def train_step(model: nn.Module, opt: torch.optim.Optimizer, rollout: Rollout,
               advantages: torch.Tensor, cfg: RLConfig, ref: nn.Module | None, log=print,
               forward: nn.Module | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """One GRPO update over the rollout in micro-batches. Returns the trainer's log-probs
    [B, L] (detached), per-token entropy [B, L] and the loss stats; stats["micro_batch_size"]
    is the size the gradients fit at: when a micro-batch runs out of device memory, the
    gradients are accumulated again from zero at half the size (down to 1), which gives the
    same update summed in more pieces, and the caller can keep the smaller size. The
    optimizer steps once, after the gradients are complete. `forward`: the module the
    forwards call, model itself (the default) or it through torch.compile."""
    size = cfg.micro_batch_size
    while True:
        try:
            lps, ents, stats = _accumulate(model, model if forward is None else forward, opt,
                                           rollout, advantages, cfg, ref, size)
            break
        except torch.OutOfMemoryError:
            if size == 1:
                raise
        # Outside the handler, whose traceback held the failed attempt's tensors.
        opt.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        log(f"rl: out of device memory at micro_batch_size {size}; accumulating this step's "
            f"gradients again at {max(1, size // 2)}")
        size = max(1, size // 2)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
    if torch.isfinite(norm):
        opt.step()
        stats["skipped"] = 0.0
    else:
        stats["skipped"] = 1.0  # a non-finite gradient: the update is dropped
    stats["grad_norm"] = float(norm)
    stats["micro_batch_size"] = size
    return lps, ents, stats


def _accumulate(model: nn.Module, forward: nn.Module, opt: torch.optim.Optimizer,
                rollout: Rollout, advantages: torch.Tensor, cfg: RLConfig, ref: nn.Module | None,
                size: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The update's gradients in micro-batches of `size` rows, from zero, the forwards through
    `forward` (model, or it compiled; routing is replayed on model's own blocks): (log-probs,
    entropy, loss stats)."""
    B = rollout.tokens.shape[0]
    n_tokens = rollout.response_mask.sum().clamp(min=1)
    starts = range(0, B, size)
    # Each micro-batch's share of the response tokens (the loss is a token-mean over the whole
    # batch), read on the host once rather than once per micro-batch.
    shares = torch.stack([rollout.response_mask[i:i + size].sum() / n_tokens
                          for i in starts]).tolist()
    lps, ents, stats_sum = [], [], {}
    opt.zero_grad(set_to_none=True)
    # A qat-w trainer's micro-batches read the same weights: each is quantized once.
    with weight_operands_once():
        for start, share in zip(starts, shares, strict=True):
            rows = slice(start, start + size)
            tokens, mask = rollout.tokens[rows], rollout.mask[rows]
            resp = rollout.response_mask[rows]
            routing = _slice_routing(rollout.routing if cfg.routing_replay else None, rows)
            with (replay_routing(model, routing) if routing else nullcontext(),
                  trainer_autocast(cfg, tokens.device)):
                logp, entropy = lm.token_logprobs(forward, tokens, mask, cfg.temperature or 1.0,
                                                  entropy=True)
            old = logp.detach()
            weights = rollout_correction(old, rollout.logprobs[rows], resp, cfg.correction,
                                         cfg.correction_cap)
            logp_ref = None
            if ref is not None:
                with torch.no_grad(), trainer_autocast(cfg, tokens.device):
                    logp_ref = lm.token_logprobs(ref, tokens, mask, cfg.temperature or 1.0)
            loss, stats = grpo_loss(logp, old, advantages[rows], resp, clip_low=cfg.clip_low,
                                    clip_high=cfg.clip_high, weights=weights, logp_ref=logp_ref,
                                    kl_coef=cfg.kl_coef)
            (loss * share).backward()
            for k, v in stats.items():
                stats_sum[k] = stats_sum.get(k, 0.0) + float(v) * share
            lps.append(old)
            ents.append(entropy.detach())
    return torch.cat(lps), torch.cat(ents), stats_sum
