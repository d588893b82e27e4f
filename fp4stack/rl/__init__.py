"""Reinforcement learning: trainer-rollout mismatch metrics and GRPO loss pieces."""

from .grpo_loss import group_advantages, grpo_loss, rollout_correction
from .metrics import MismatchAlarm, MismatchAlarmError, mismatch_metrics

__all__ = ["MismatchAlarm", "MismatchAlarmError", "group_advantages", "grpo_loss",
           "mismatch_metrics", "rollout_correction"]
