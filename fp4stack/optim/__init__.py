"""Optimizers whose states are stored in NVFP4."""

from .adamw4 import AdamW4
from .muon4 import Muon4
from .root import ROOT, ROOT4
from .state_format import StateFormat

__all__ = ["ROOT", "ROOT4", "AdamW4", "Muon4", "StateFormat"]
