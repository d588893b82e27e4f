"""ROOT and ROOT4: Muon4 with ROOT's shape-adaptive Newton-Schulz and outlier soft-threshold.

ROOT (He et al., "ROOT: Robust Orthogonalized Optimizer for Neural Network Training", arXiv
2511.20626) changes two things in Muon: the Newton-Schulz coefficients depend on the matrix
shape, and before orthogonalising, the update U is split by a soft-threshold into outliers
O = sign(U) max(|U| - eps, 0) and a clipped part B = U - O, of which only B is orthogonalised.
Both are options of Muon4 (`ns_coefficients="root"`, `outlier_quantile`); what the sources
confirm and what fp4stack assumes is in optim/root_ns.py.

ROOT4 is ROOT with Muon4's NVFP4 Newton-Schulz (every GEMM operand NVFP4, fp32 accumulation)
and NVFP4 momentum, its other parameters on AdamW4: the "Muon" of the Full-Stack FP4 recipe.
Muon4's momentum, Muon4(momentum * M + (1 - momentum) * G), is (1 - momentum) times the
reference code's (momentum * M + G); the quantile threshold and the Frobenius normalisation of
Newton-Schulz are scale-free, so the update is the same.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from .muon4 import Muon4
from .root_ns import DEFAULT_OUTLIER_QUANTILE


class ROOT(Muon4):
    """Muon4 with ns_coefficients="root" and outlier_quantile=0.9 (the reference code's), plain
    (quantize=False: bf16 Newton-Schulz, fp32 momentum, torch's AdamW for the other params)
    unless quantize is given. Every other argument is Muon4's; lr conventions are Muon4's
    (adjust_lr_fn "original"; the reference code uses "match_rms_adamw")."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        *,
        quantize: bool = False,
        outlier_quantile: float | None = DEFAULT_OUTLIER_QUANTILE,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("ns_coefficients", "root")
        super().__init__(params, lr, momentum, nesterov, weight_decay, ns_steps,
                         quantize=quantize, outlier_quantile=outlier_quantile, **kwargs)


class ROOT4(ROOT):
    """ROOT with NVFP4 Newton-Schulz operands and NVFP4 momentum (Muon4's quantize=True), the
    other parameters on AdamW4."""

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], *args: Any,
                 quantize: bool = True, **kwargs: Any) -> None:
        super().__init__(params, *args, quantize=quantize, **kwargs)
