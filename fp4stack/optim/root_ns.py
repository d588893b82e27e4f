"""ROOT's two changes to Muon (arXiv 2511.20626), as pure functions: shape-adaptive Newton-Schulz
coefficients and the soft-threshold split of outliers from the update before orthogonalization.

What the authors' public reference code (huawei-noah/noah-research, ROOT/) confirms:
- coefficients per matrix shape, keyed by (min(rows, cols), max(rows, cols)), for the five-step
  quintic of Muon (X <- aX + (bA + cA²)X); it lists four shapes of its 2048-wide model
  (ROOT_TABLE) and falls back to Muon's coefficients for any other shape. How the paper fitted
  them is not in the code;
- the soft-threshold: with eps the 0.9-quantile of |U| (U the Nesterov update) plus 1e-9,
  O = sign(U) max(|U| - eps, 0) are the outliers and B = U - O = clamp(U, -eps, eps) is what is
  orthogonalised. The paper's algorithm names eps a fixed threshold; the code's is adaptive.

What fp4stack assumes where the sources are silent:
- shapes outside the table get coefficients fitted here (`fit_coefficients`), not Muon's: a
  Levenberg-Marquardt least-squares fit of the `steps`-fold quintic's deviation from 1 over the
  singular values of a Frobenius-normalised Gaussian matrix of that shape (512 quantiles of
  the Marchenko-Pastur law, scaled by 1/sqrt(min side)), started from Muon's coefficients and
  accepting only polynomials that stay positive and map [0, P] into itself for their peak
  P <= 1.25 on [0, 1] (so iterates cannot grow without bound). The fit is deterministic;
- a threshold of exactly 0 (at least that quantile of the entries are 0) leaves the matrix
  unclipped (the reference's +1e-9 would instead clip every entry to +-1e-9, a sign-like
  update, and it is not scale-free);
- the quantile is of each matrix on its own (a 3-D expert stack: per expert).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

from .newton_schulz import NS_COEFFICIENTS

Coefficients = tuple[float, float, float]
NS_COEFFICIENT_KINDS = ("muon", "root")
# (min side, max side) -> (a, b, c) for five steps, as listed by the ROOT reference code.
ROOT_TABLE: dict[tuple[int, int], Coefficients] = {
    (2048, 2048): (3.4916, -4.8224, 2.1095),
    (2048, 3072): (3.4509, -4.5790, 1.9325),
    (2048, 8192): (2.9794, -3.6674, 1.6207),
    (2048, 16384): (3.1943, -3.8221, 1.5322),
}
TABLE_STEPS = 5
DEFAULT_OUTLIER_QUANTILE = 0.9  # the reference code's
_FIT_POINTS = 512
_FIT_ITERS = 100
_PEAK_MAX = 1.25
_F64 = torch.float64


def mp_singular_values(rows: int, cols: int, points: int = _FIT_POINTS) -> Tensor:
    """`points` quantiles (at (i + 0.5) / points) of the singular values of G / ||G||_F for a
    rows x cols Gaussian G, from the Marchenko-Pastur law (float64, ascending).

    With m <= n the sides and ratio r = m / n, the eigenvalues x of G Gᵀ / n follow MP on
    [(1 - sqrt r)², (1 + sqrt r)²] and ||G||_F² ~ m n, so a singular value is sqrt(x / m). The
    CDF is integrated in the angle x = x- + (x+ - x-)(1 - cos t) / 2, where the density times
    dx is smooth (even at the hard edge x- = 0 of a square matrix)."""
    m, n = min(rows, cols), max(rows, cols)
    r = m / n
    lo, hi = (1 - math.sqrt(r)) ** 2, (1 + math.sqrt(r)) ** 2
    t = torch.linspace(0.0, math.pi, 20001, dtype=_F64)
    x = lo + (hi - lo) * (1 - torch.cos(t)) / 2
    half = (hi - lo) / 2
    # sin(t)² / x -> 4 / (hi - lo) as t -> 0 when lo = 0 (x ~ (hi - lo) t² / 4).
    ratio = torch.where(x > 0, torch.sin(t) ** 2 / x.clamp(min=1e-300), 4 / (hi - lo))
    density = half**2 * ratio / (2 * math.pi * r)
    steps = (density[1:] + density[:-1]) / 2 * (t[1] - t[0])
    cdf = torch.cat([torch.zeros(1, dtype=_F64), torch.cumsum(steps, 0)])
    cdf = cdf / cdf[-1]
    q = (torch.arange(points, dtype=_F64) + 0.5) / points
    i = torch.searchsorted(cdf, q).clamp(1, len(cdf) - 1)
    w = (q - cdf[i - 1]) / (cdf[i] - cdf[i - 1])
    return ((x[i - 1] + w * (x[i] - x[i - 1])) / m).sqrt()


def quintic(s: Tensor, coefficients: Coefficients | Tensor, steps: int) -> Tensor:
    """The scalar map of `steps` Newton-Schulz steps on singular values s."""
    a, b, c = coefficients
    for _ in range(steps):
        s2 = s * s
        s = s * (a + s2 * (b + c * s2))
    return s


def _stable(coefficients: Tensor) -> bool:
    """One step positive on (0, P] and mapping [0, P] into itself, P its peak on [0, 1]."""
    peak = quintic(torch.linspace(0, 1, 2001, dtype=_F64), coefficients, 1).max().item()
    y = quintic(torch.linspace(0, peak, 2001, dtype=_F64)[1:], coefficients, 1)
    return peak <= _PEAK_MAX and y.max().item() <= peak * (1 + 1e-12) and y.min().item() > 0


def fit_coefficients(rows: int, cols: int, steps: int = TABLE_STEPS) -> Coefficients:
    """(a, b, c) minimising the mean squared deviation from 1 of `steps` quintic steps over the
    Gaussian singular values of a rows x cols matrix (see the module docstring)."""
    s = mp_singular_values(rows, cols)
    p = torch.tensor(NS_COEFFICIENTS, dtype=_F64)

    def residual(q: Tensor) -> Tensor:
        return quintic(s, q, steps) - 1

    r = residual(p)
    loss, damping = (r * r).mean(), 1e-3
    eye = torch.eye(3, dtype=_F64)
    for _ in range(_FIT_ITERS):
        h = 1e-6
        jac = torch.stack([(residual(p + h * e) - residual(p - h * e)) / (2 * h) for e in eye], 1)
        jtj, jtr = jac.T @ jac, jac.T @ r
        while damping < 1e9:
            candidate = p + torch.linalg.solve(jtj + damping * torch.diag(jtj.diagonal()), -jtr)
            r_new = residual(candidate)
            loss_new = (r_new * r_new).mean()
            if loss_new < loss and _stable(candidate):
                p, r, loss, damping = candidate, r_new, loss_new, max(damping / 3, 1e-9)
                break
            damping *= 4
        else:
            break  # no feasible improving step left
    return tuple(round(v, 6) for v in p.tolist())  # type: ignore[return-value]


@lru_cache(maxsize=256)
def root_coefficients(rows: int, cols: int, steps: int = TABLE_STEPS) -> Coefficients:
    """ROOT's Newton-Schulz coefficients for a rows x cols matrix: the published ones for the
    shapes of ROOT_TABLE (five steps), else `fit_coefficients` (computed once per shape)."""
    key = (min(rows, cols), max(rows, cols))
    if steps == TABLE_STEPS and key in ROOT_TABLE:
        return ROOT_TABLE[key]
    return fit_coefficients(*key, steps)


def ns_coefficients(kind: str, rows: int, cols: int, steps: int) -> Coefficients:
    """The coefficients of a matrix's Newton-Schulz: "muon" (Keller Jordan's, for every shape)
    or "root" (root_coefficients)."""
    if kind == "muon":
        return NS_COEFFICIENTS
    if kind == "root":
        return root_coefficients(rows, cols, steps)
    raise ValueError(f"ns_coefficients must be one of {NS_COEFFICIENT_KINDS}, got {kind!r}")


def outlier_threshold(u: Tensor, quantile: float, per_matrix: bool = False) -> Tensor:
    """The `quantile` of |u| over all its entries (0-d, u's float dtype), linearly interpolated
    between order statistics as torch.quantile does (which refuses tensors over 2^24 entries).
    per_matrix: of each matrix of a stack [B, rows, cols] on its own, as [B, 1, 1] (the same
    order statistics, selected along each matrix's entries)."""
    flat = u.detach().abs()
    flat = flat.reshape(flat.shape[0], -1) if per_matrix else flat.reshape(1, -1)
    pos = quantile * (flat.shape[1] - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    low = flat.kthvalue(lo + 1, dim=1).values
    if hi != lo:
        low = torch.lerp(low, flat.kthvalue(hi + 1, dim=1).values, pos - lo)
    return low[:, None, None] if per_matrix else low.reshape(())


def clip_outliers(u: Tensor, quantile: float) -> Tensor:
    """ROOT's robust part B = u - T_eps(u) = clamp(u, -eps, eps) of a matrix u, with eps the
    `quantile` of |u| and T_eps the soft-threshold sign(u) max(|u| - eps, 0) (the outliers,
    dropped). eps = 0 (mostly zero entries) leaves u as it is. A stack [B, rows, cols]: each
    matrix with its own eps."""
    eps = outlier_threshold(u, quantile, per_matrix=u.dim() == 3)
    return torch.where(eps > 0, torch.clamp(u, -eps, eps), u)  # no host sync
