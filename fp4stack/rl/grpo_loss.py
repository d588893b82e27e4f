"""GRPO building blocks: group-relative advantages, rollout correction weights, clipped loss.

All tensors are per sampled token, [B, T] with a mask that is true at response tokens; values at
padding are ignored (they may be -inf or nan) and get zero loss and zero gradient.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .metrics import _response_mask

ROLLOUT_CORRECTION_MODES = ("none", "token-tis", "token-mis", "seq-tis", "seq-mis")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def group_advantages(rewards: Tensor, group_size: int, *, normalize_std: bool = True,
                     eps: float = 1e-6) -> Tensor:
    """Advantages [N*G] of rewards [N*G] whose groups are contiguous (rows i*G .. i*G+G-1).

    A = (r - group mean) / (group std + eps), with the population std (unbiased=False: defined
    for G = 1 and the same for every group size); normalize_std=False gives r - group mean
    (Dr. GRPO). A group whose rewards are all equal gets exactly zero advantages. Integer or
    bool rewards give float32 advantages.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} "
                         f"entries, got shape {tuple(rewards.shape)}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    r = rewards.detach()
    r = r if r.is_floating_point() else r.float()
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards has non-finite values")
    g = r.view(-1, group_size)
    adv = g - g.mean(1, keepdim=True)
    if normalize_std:
        adv = adv / (g.std(1, unbiased=False, keepdim=True) + eps)
    # Rounding in the mean would leave tiny nonzero values (then scaled by 1/eps) in a flat group.
    flat = g.amax(1, keepdim=True) == g.amin(1, keepdim=True)
    return torch.where(flat, torch.zeros_like(adv), adv).view(-1)


def _check_same(name: str, x: Tensor, ref: Tensor) -> None:
    if x.shape != ref.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(ref.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a float tensor, got {x.dtype}")


def _masked_diff(a: Tensor, b: Tensor, m: Tensor) -> Tensor:
    # where() rather than a product: padding may hold -inf/nan, and nan * 0 is nan.
    return torch.where(m, a - b, torch.zeros((), dtype=a.dtype, device=a.device))


def rollout_correction(logp_old: Tensor, logp_rollout: Tensor, mask: Tensor, mode: str = "none",
                       cap: float = 2.0) -> Tensor:
    """Detached weights [B, T] for tokens sampled by a rollout engine whose distribution differs
    from the trainer's.

    With r = exp(logp_old - logp_rollout) per token and w_i = exp(sum_t log r_{i,t}) per sequence:
      none       1
      token-tis  min(r, cap)                      (truncated importance sampling)
      token-mis  r if r <= cap else 0             (masked importance sampling)
      seq-tis    min(w_i, cap) on every token of sequence i
      seq-mis    1 if 1/cap <= w_i <= cap else 0 on every token of sequence i (needs cap >= 1)
    Weights are zero at padding; their dtype is logp_old's, float32 at least.
    """
    if mode not in ROLLOUT_CORRECTION_MODES:
        raise ValueError(f"mode must be one of {ROLLOUT_CORRECTION_MODES}, got {mode!r}")
    if not (isinstance(cap, (int, float)) and cap > 0 and math.isfinite(cap)):
        raise ValueError(f"cap must be a finite number > 0, got {cap!r}")
    if mode == "seq-mis" and cap < 1:
        raise ValueError(f"seq-mis keeps sequences with 1/cap <= w <= cap: cap must be >= 1, "
                         f"got {cap!r}")
    if logp_old.dim() != 2:
        raise ValueError(f"logp_old must be [B, T], got {tuple(logp_old.shape)}")
    _check_same("logp_rollout", logp_rollout, logp_old)
    if not logp_old.is_floating_point():
        raise ValueError(f"logp_old must be a float tensor, got {logp_old.dtype}")
    m = _response_mask(mask, logp_old.shape)
    # Weights in bf16 would keep under three significant digits; float32 at least.
    out_dtype = torch.promote_types(logp_old.dtype, torch.float32)
    if mode == "none":
        return m.to(out_dtype)
    with torch.no_grad():
        d = _masked_diff(logp_old.double(), logp_rollout.double(), m)
        if not bool(torch.isfinite(d).all()):
            raise ValueError("logp_old or logp_rollout has non-finite values at response tokens")
        log_cap = math.log(cap)
        if mode == "token-tis":
            w = torch.exp(d.clamp(max=log_cap))
        elif mode == "token-mis":
            w = torch.where(d <= log_cap, torch.exp(d), 0.0)
        else:
            s = d.sum(1, keepdim=True)
            if mode == "seq-tis":
                w = torch.exp(s.clamp(max=log_cap)).expand_as(d)
            else:
                w = (s.abs() <= log_cap).double().expand_as(d)
        return torch.where(m, w, 0.0).to(out_dtype)


def grpo_loss(logp: Tensor, logp_old: Tensor, advantages: Tensor, mask: Tensor, *,
              clip_low: float = 0.2, clip_high: float = 0.2, weights: Tensor | None = None,
              logp_ref: Tensor | None = None, kl_coef: float = 0.0,
              aggregation: str = "token-mean") -> tuple[Tensor, dict[str, float]]:
    """PPO-clipped GRPO loss and its statistics.

    logp [B, T]: current policy log-probs of the sampled tokens (differentiable); logp_old [B, T]:
    the trainer's log-probs at rollout time (detached); advantages [B], one per sequence; mask
    [B, T]. Per response token, with ratio = exp(logp - logp_old) and A the sequence advantage:

      loss_t = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A) * weight_t
               + kl_coef * (exp(logp_ref - logp) - (logp_ref - logp) - 1)

    `weights` (from rollout_correction) scale the policy term only; the k3 KL term to the
    reference policy needs logp_ref. Aggregation over the L response tokens of a [B, T] batch:
      token-mean           sum_t loss_t / L
      seq-mean-token-mean  mean over sequences with a response token of their mean token loss
      seq-mean-token-sum   sum_t loss_t / (B * T): a constant divisor, so a sequence's weight does
                           not depend on its length (Dr. GRPO; pad to a fixed T to keep it fixed)
    Stats: loss, clip_frac (share of response tokens whose clipped term is the active one),
    ratio_mean, ratio_max, weight_mean and, with logp_ref, kl (mean k3 per response token).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if not (clip_low >= 0 and clip_low < 1):
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low!r}")
    if not (clip_high >= 0 and math.isfinite(clip_high)):
        raise ValueError(f"clip_high must be a finite number >= 0, got {clip_high!r}")
    if not (kl_coef >= 0 and math.isfinite(kl_coef)):
        raise ValueError(f"kl_coef must be a finite number >= 0, got {kl_coef!r}")
    if kl_coef > 0 and logp_ref is None:
        raise ValueError("kl_coef > 0 needs logp_ref")
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got {tuple(logp.shape)}")
    if not logp.is_floating_point():
        raise ValueError(f"logp must be a float tensor, got {logp.dtype}")
    _check_same("logp_old", logp_old, logp)
    for name, x in (("weights", weights), ("logp_ref", logp_ref)):
        if x is not None:
            _check_same(name, x, logp)
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [B] = [{logp.shape[0]}], got "
                         f"{tuple(advantages.shape)}")
    m = _response_mask(mask, logp.shape)
    n_tok = int(m.sum())
    if n_tok == 0:
        raise ValueError("mask selects no response tokens")

    # Low-precision log-probs are upcast: exp of a bf16 difference is too coarse for the ratio.
    dt = torch.promote_types(logp.dtype, torch.float32)
    zero = torch.zeros((), dtype=dt, device=logp.device)
    lp = logp.to(dt)
    log_ratio = _masked_diff(lp, logp_old.detach().to(dt), m)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(dt).unsqueeze(1)
    pg = ratio * adv
    pg_clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    per_tok = -torch.minimum(pg, pg_clipped)
    # w is zero at padding, and so is every padding token's loss (ratio 1, KL 0 there).
    w = torch.where(m, weights.detach().to(dt), zero) if weights is not None else m.to(dt)
    per_tok = per_tok * w
    kl = None
    if logp_ref is not None:
        delta = _masked_diff(logp_ref.detach().to(dt), lp, m)
        kl = torch.expm1(delta) - delta
        if kl_coef > 0:
            per_tok = per_tok + kl_coef * kl

    if aggregation == "token-mean":
        loss = per_tok.sum() / n_tok
    elif aggregation == "seq-mean-token-mean":
        lens = m.sum(1)
        has = lens > 0
        loss = (per_tok.sum(1)[has] / lens[has]).mean()
    else:
        loss = per_tok.sum() / per_tok.numel()

    with torch.no_grad():
        rm = ratio[m]
        vals = [loss.detach(), (pg_clipped[m] < pg[m]).to(dt).mean(), rm.mean(), rm.max(),
                w[m].mean()]
        if kl is not None:
            vals.append(kl[m].mean())
        keys = ["loss", "clip_frac", "ratio_mean", "ratio_max", "weight_mean", "kl"][:len(vals)]
        stats = dict(zip(keys, torch.stack(vals).tolist(), strict=True))
    return loss, stats
