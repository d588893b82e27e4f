"""Pretraining: config, loop, checkpoints, logs, torch.distributed (DDP / FSDP2)."""

from .config import PretrainConfig, from_dict, load_config
from .metrics import read_metrics
from .trainer import NonFiniteLossError, train

__all__ = ["NonFiniteLossError", "PretrainConfig", "from_dict", "load_config", "read_metrics",
           "train"]
