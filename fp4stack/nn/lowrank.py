"""Full-Stack FP4 low-rank branch: a rank-r correction of the weight's quantization error."""

from __future__ import annotations

import torch

from ..api import fake_quantize
from ..formats.spec import QuantSpec


def lowrank_factors(weight: torch.Tensor, spec: QuantSpec, rank: int):
    """(A [r, K], B [N, r]) with B A the best rank-r approximation of W - Q(W) (truncated SVD,
    singular values split evenly between the factors), in float32."""
    w = weight.detach().float()
    err = w - (fake_quantize(w, spec=spec) if spec.format != "none" else w)
    rank = min(rank, *err.shape)
    u, s, vh = torch.linalg.svd(err, full_matrices=False)
    root = s[:rank].sqrt()
    return root[:, None] * vh[:rank], u[:, :rank] * root[None, :]
