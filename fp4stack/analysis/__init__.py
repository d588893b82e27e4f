"""Error analysis: how much each way of quantizing loses, measured on the library's own numerics."""

from .quant_error import DISTRIBUTIONS, METHODS, ErrorRow, error_table, format_table, make_tensor

__all__ = ["DISTRIBUTIONS", "METHODS", "ErrorRow", "error_table", "format_table", "make_tensor"]
