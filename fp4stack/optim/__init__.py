"""Optimizers whose states are stored in NVFP4."""

from .adamw4 import AdamW4
from .muon4 import Muon4

__all__ = ["AdamW4", "Muon4"]
