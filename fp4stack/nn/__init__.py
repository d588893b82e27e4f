"""Layers built on the numerics core: recipes, the quantized linear layer, MoE, packed state."""

from .fused import FUSED_GROUPS, shared_amax
from .linear import QuantLinear, quantize_operand
from .packed import PackedSlot, PackedState
from .recipe import PRESETS, LowRank, Recipe, ResidualCompensation, recipe

__all__ = [
    "FUSED_GROUPS", "PRESETS", "LowRank", "PackedSlot", "PackedState", "QuantLinear", "Recipe",
    "ResidualCompensation", "quantize_operand", "recipe", "shared_amax",
]
