"""SVDQuant's split of a weight: a principal low-rank part kept in high precision, the rest NVFP4.

    y = x Lᵀ + Q(x) Q(W - L)ᵀ,    L = B C A,  C = Bᵀ W Aᵀ  [r, r]

A [r, K] and B [N, r] hold orthonormal bases of W's top-r right and left singular subspaces,
fitted by a randomized SVD (a fixed seed, so every refit of the same W gives the same bits, eager
or compiled) and refitted every `LowRank.refresh_every` training forwards. Between refits L is
the projection of the current W onto those subspaces: right after a fit it is W's best rank-r
approximation, and it follows W as W trains. L is a linear function of W, so autograd carries
the gradient to W through both parts: P_B (dyᵀ x) P_A from the high-precision part and
(I - P_B ⊗ P_A) applied to the quantized GEMM's straight-through dW from the residual
(P_B = B Bᵀ, P_A = Aᵀ A). The low-rank product takes the unquantized x, as SVDQuant's 16-bit
branch does: the split moves W's largest directions out of the quantizer, and quantizing x
there would put back an error the split exists to avoid.
"""

from __future__ import annotations

import torch

# Extra sample columns and power iterations of the randomized range finder (Halko, Martinsson
# and Tropp 2011): with W's spectrum decaying even slowly, 2 iterations find the top-r subspace
# to well below the NVFP4 error of the residual.
OVERSAMPLE = 8
POWER_ITERATIONS = 2
SEED = 0


def principal_factors(weight: torch.Tensor, rank: int, seed: int = SEED):
    """(A [r, K], B [N, r]), float32, with orthonormal rows of A and columns of B spanning W's
    top-r right and left singular subspaces: B (Bᵀ W Aᵀ) A is W's best rank-r approximation.

    A randomized SVD with `seed`; an exact SVD when the sketch would be as wide as W's
    smaller side anyway."""
    w = weight.detach().float()
    n, k = w.shape
    rank = min(rank, n, k)
    width = rank + OVERSAMPLE
    if width >= min(n, k):
        u, _, vh = torch.linalg.svd(w, full_matrices=False)
        return vh[:rank].contiguous(), u[:, :rank].contiguous()
    g = torch.Generator(device=w.device).manual_seed(seed)
    q = torch.linalg.qr(w @ torch.randn(k, width, generator=g, device=w.device)).Q
    for _ in range(POWER_ITERATIONS):  # re-orthonormalised each half step: fp32 stays stable
        q = torch.linalg.qr(w @ torch.linalg.qr(w.t() @ q).Q).Q
    u, _, vh = torch.linalg.svd(q.t() @ w, full_matrices=False)
    return vh[:rank].contiguous(), (q @ u[:, :rank]).contiguous()


def split_weight(weight: torch.Tensor, factor_a: torch.Tensor, factor_b: torch.Tensor):
    """(C [r, r], W - L [N, K]) for L = B C A, C = Bᵀ W Aᵀ, in W's dtype and differentiable
    in W. Autocast is off here: the split is exact in the master weight's precision, and the
    low-rank product (`lowrank_product`) then runs in the compute dtype."""
    with torch.autocast(weight.device.type, enabled=False):
        a, b = factor_a.to(weight.dtype), factor_b.to(weight.dtype)
        core = b.t() @ weight @ a.t()
        return core, weight - b @ core @ a


def lowrank_product(x2: torch.Tensor, factor_a: torch.Tensor, core: torch.Tensor,
                    factor_b: torch.Tensor) -> torch.Tensor:
    """x Lᵀ = ((x Aᵀ) Cᵀ) Bᵀ for x2 [T, K], three thin GEMMs in x's dtype (autocast's when on)."""
    dt = x2.dtype
    return ((x2 @ factor_a.to(dt).t()) @ core.to(dt).t()) @ factor_b.to(dt).t()
