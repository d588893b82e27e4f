"""Layers built on the numerics core: recipes, the quantized linear layer, MoE."""

from .linear import QuantLinear, quantize_operand
from .recipe import PRESETS, LowRank, Recipe, ResidualCompensation, recipe

__all__ = [
    "PRESETS", "LowRank", "QuantLinear", "Recipe", "ResidualCompensation", "quantize_operand",
    "recipe",
]
