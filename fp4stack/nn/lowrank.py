"""Full-Stack FP4's low-rank part: a rank-r branch fitted to the weight's quantization error, or
(fit="weight") the factors of SVDQuant's split of W (lowrank_split.py), and their refit."""

from __future__ import annotations

import torch

from ..api import fake_quantize
from ..formats.spec import QuantSpec
from ..ops import spec_from_key
from .lowrank_split import principal_factors
from .rows import gather_rows


def lowrank_factors(weight: torch.Tensor, spec: QuantSpec, rank: int):
    """(A [r, K], B [N, r]) with B A the best rank-r approximation of W - Q(W) (truncated SVD,
    singular values split evenly between the factors), in float32."""
    w = weight.detach().float()
    err = w - (fake_quantize(w, spec=spec) if spec.format != "none" else w)
    rank = min(rank, *err.shape)
    u, s, vh = torch.linalg.svd(err, full_matrices=False)
    root = s[:rank].sqrt()
    return root[:, None] * vh[:rank], u[:, :rank] * root[None, :]


def fit_factors(weight: torch.Tensor, spec: QuantSpec, rank: int, fit: str = "error"):
    """The factors (A [r, K], B [N, r]) a LowRank of this `fit` keeps: "error" the branch's
    (`lowrank_factors`), "weight" the bases of W's principal part (`principal_factors`)."""
    if fit == "weight":
        return principal_factors(weight, rank)
    return lowrank_factors(weight, spec, rank)


@torch.library.custom_op("fp4stack::lowrank_count_and_refresh",
                         mutates_args=("count", "factor_a", "factor_b"))
def count_and_refresh(count: torch.Tensor, factor_a: torch.Tensor, factor_b: torch.Tensor,
                      weight: torch.Tensor, every: int, spec: str, fit: str = "error",
                      shards: int = 1, group_key: int = 0) -> None:
    """One more training forward: `count` (int64 0-d) += 1, and when it reaches a multiple of
    `every` the factors are refitted in place (`fit_factors`: from W - Q(W), Q by `spec`, a
    `spec_key`, or from W for fit="weight"). shards > 1: `weight` is this rank's rows of W,
    all-gathered for the refit over the process group `nn.rows` has as `group_key`.

    A custom op so that torch.compile keeps the decision inside the graph, as one node: the
    count is read inside the op. QuantLinear keeps it on the CPU, so that read never waits for
    the device."""
    n = int(count) + 1
    count.fill_(n)
    if n % every == 0:
        if shards > 1:
            weight = gather_rows(weight, shards, group_key)
        a, b = fit_factors(weight, spec_from_key(spec), factor_a.shape[0], fit)
        factor_a.copy_(a)
        factor_b.copy_(b)


@count_and_refresh.register_fake
def _(count, factor_a, factor_b, weight, every, spec, fit="error", shards=1, group_key=0):
    return None
