"""Error analysis: how much each way of quantizing loses, measured on the library's own numerics."""

from .attribution import Compensated, LayerError, attribute_error, layer_errors
from .attribution_report import summarize
from .quant_error import DISTRIBUTIONS, METHODS, ErrorRow, error_table, format_table, make_tensor
from .weight_flips import WeightFlips

__all__ = [
    "DISTRIBUTIONS", "METHODS", "Compensated", "ErrorRow", "LayerError", "attribute_error",
    "WeightFlips", "error_table", "format_table", "layer_errors", "make_tensor", "summarize",
]
