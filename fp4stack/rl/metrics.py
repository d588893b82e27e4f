"""Trainer-rollout mismatch: how far the rollout engine's token distribution is from the trainer's.

Over response tokens, lp is the trainer's log-prob of the sampled token, lq the rollout engine's,
d = lp - lq and r = exp(d). Token statistics average over every response token of the batch
(token-mean); sequence statistics use each sequence's log-ratio s_i = sum_t d_{i,t} and so the
sequence importance ratio w_i = exp(s_i):

  k1 = mean(lq - lp)         k2 = mean(d^2) / 2         k3 = mean(r - 1 - d)
  chi2_token = mean(r^2) - 1                            chi2_seq = mean_i(w_i^2) - 1
  ess = 1 / mean_i((w_i / mean_j w_j)^2), in [1/n_seq, 1]; 1 means no mismatch
  geo_ratio_mean = mean_i exp(s_i / n_i), n_i the response length of sequence i

Sequences without response tokens are left out of the sequence statistics. Quantities that sum or
square ratios go through log-sum-exp in float64, so ess stays exact for |s_i| in the hundreds;
only chi2_seq, chi2_token and seq_ratio_max can overflow, and only when the true value is past
the float64 range.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

from ..nn.recipe_types import Recipe

METRIC_KEYS = ("k1", "k2", "k3", "logp_diff_mean", "logp_diff_max", "prob_diff_mean",
               "prob_diff_max", "chi2_token", "chi2_seq", "ess", "seq_ratio_max",
               "seq_ratio_min", "geo_ratio_mean", "n_tokens")


def _response_mask(mask: Tensor, shape: torch.Size) -> Tensor:
    if mask.shape != shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {tuple(shape)}")
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must be bool or hold only 0 and 1")
    return mask != 0


def _check_logp(name: str, x: Tensor, m: Tensor) -> None:
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a float tensor, got {x.dtype}")
    if not bool(torch.isfinite(x[m]).all()):
        raise ValueError(f"{name} has non-finite values at response tokens (mask == 1)")


def mismatch_metrics(lp: Tensor, lq: Tensor, mask: Tensor) -> dict[str, float]:
    """Mismatch statistics between trainer log-probs `lp` and rollout log-probs `lq`.

    lp, lq: [B, T] log-probs of the sampled tokens; mask: [B, T], true at response tokens. Values
    at padding are ignored (engines often put -inf or nan there). Returns the floats named in
    METRIC_KEYS (n_tokens as an int). Raises ValueError on a shape mismatch, an empty mask or a
    non-finite log-prob at a response token.
    """
    if lp.dim() != 2 or lp.shape != lq.shape:
        raise ValueError(f"lp and lq must both be [B, T], got {tuple(lp.shape)} and "
                         f"{tuple(lq.shape)}")
    m = _response_mask(mask, lp.shape)
    if not bool(m.any()):
        raise ValueError("mask selects no response tokens")
    _check_logp("lp", lp, m)
    _check_logp("lq", lq, m)

    lp64 = torch.where(m, lp.detach().double(), 0.0)
    lq64 = torch.where(m, lq.detach().double(), 0.0)
    d_all = lp64 - lq64  # exactly 0 at padding
    d = d_all[m]
    n = d.numel()
    log_n = math.log(n)

    # expm1 keeps k3 and chi2 accurate when d is tiny (the usual case), where r - 1 would cancel.
    k3 = (torch.expm1(d) - d).mean()
    chi2_token = torch.expm1(torch.logsumexp(2 * d, 0) - log_n)
    prob_diff = (torch.exp(lp64[m]) - torch.exp(lq64[m])).abs()

    lens = m.sum(1)
    has = lens > 0
    s = d_all.sum(1)[has]
    log_ns = math.log(s.numel())
    lse1 = torch.logsumexp(s, 0)
    lse2 = torch.logsumexp(2 * s, 0)
    # mean(w~^2) = n * sum(w^2) / sum(w)^2; the shift by max(s) inside logsumexp keeps it finite.
    ess = torch.exp(2 * lse1 - lse2 - log_ns).clamp(max=1.0)
    chi2_seq = torch.expm1(lse2 - log_ns)
    geo = torch.exp(s / lens[has]).mean()

    vals = torch.stack([
        -d.mean(), 0.5 * (d * d).mean(), k3, d.abs().mean(), d.abs().max(), prob_diff.mean(),
        prob_diff.max(), chi2_token, chi2_seq, ess, torch.exp(s.max()), torch.exp(s.min()), geo,
    ]).tolist()
    out = dict(zip(METRIC_KEYS[:-1], vals, strict=True))
    out["n_tokens"] = n
    return out


class MismatchAlarmError(RuntimeError):
    """Raised by a MismatchAlarm with action="stop"."""


# Metrics where a small value signals mismatch: the alarm fires below the threshold for these.
LOWER_IS_WORSE = frozenset({"ess", "seq_ratio_min"})


class MismatchAlarm:
    """Warns or stops when a mismatch metric is past its threshold `patience` checks in a row.

    "Past" means above the threshold, except for the metrics in LOWER_IS_WORSE (ess,
    seq_ratio_min), where it means below. A NaN value counts as past. Once the streak reaches
    `patience`, every further check in the streak fires again; a check within bounds resets it.
    """

    def __init__(self, metric: str = "k3", threshold: float = 1e-2, action: str = "warn",
                 patience: int = 1) -> None:
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"metric must be a non-empty metric name, got {metric!r}")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
                or not math.isfinite(threshold):
            raise ValueError(f"threshold must be a finite number, got {threshold!r}")
        if action not in ("warn", "stop"):
            raise ValueError(f"action must be 'warn' or 'stop', got {action!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience must be an int >= 1, got {patience!r}")
        self.metric = metric
        self.threshold = float(threshold)
        self.action = action
        self.patience = patience
        self.streak = 0

    def _past(self, value: float) -> bool:
        if math.isnan(value):
            return True
        if self.metric in LOWER_IS_WORSE:
            return value < self.threshold
        return value > self.threshold

    def check(self, step: int, metrics: dict) -> str | None:
        """Record this step's metrics; the alarm message if it fires, else None.

        With action="warn" the message is also issued through warnings.warn; with "stop" a
        MismatchAlarmError carrying it is raised instead.
        """
        if self.metric not in metrics:
            raise ValueError(f"metrics has no {self.metric!r} (keys: {sorted(metrics)})")
        value = float(metrics[self.metric])
        if not self._past(value):
            self.streak = 0
            return None
        self.streak += 1
        if self.streak < self.patience:
            return None
        side = "below" if self.metric in LOWER_IS_WORSE else "above"
        msg = (f"step {step}: trainer-rollout mismatch {self.metric} = {value:.6g} is {side} "
               f"threshold {self.threshold:.6g} for {self.streak} consecutive check(s)")
        if self.action == "stop":
            raise MismatchAlarmError(msg + " (raise threshold or patience, or use "
                                     "action='warn', to keep training)")
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        return msg


ACTIVATION_ERROR_ROWS = 8  # rollout rows the per-layer error is measured on


def activation_errors(model: torch.nn.Module, tokens: Tensor, mask: Tensor,
                      recipe: str | Recipe, compensation: float
                      ) -> tuple[dict[str, float], list[dict]]:
    """The W4A4 error of each linear layer of `model` (its master weights) on the first
    ACTIVATION_ERROR_ROWS rows of a rollout batch (every position, pads included), by
    `analysis.attribution` with `recipe`'s x and w specs and `compensation` of the channels:
    (means over layers: act_error, weight_error, w4a4_error, gap, gap_removed; each layer's
    row). Relative Frobenius errors against the unquantized GEMM (see attribution)."""
    from ..analysis.attribution import attribute_error
    from .policy import forward_logits

    rows = ACTIVATION_ERROR_ROWS
    batch = tokens[:rows], mask[:rows]

    class _Forward(torch.nn.Module):  # attribution calls model(batch)
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, b):
            return forward_logits(self.model, *b)

    layers = [r for r in attribute_error(_Forward(), batch, recipe, ks=(compensation,))
              if r.analysed]

    def mean(values) -> float:
        values = [v for v in values if math.isfinite(v)]
        return sum(values) / len(values) if values else math.nan

    summary = {"act_error": mean(r.act_only for r in layers),
               "weight_error": mean(r.weight_only for r in layers),
               "w4a4_error": mean(r.both for r in layers),
               "w4a4_gap": mean(r.gap for r in layers),
               "gap_removed": mean(r.compensated[0].gap_removed for r in layers)}
    return summary, [r.to_dict() for r in layers]
