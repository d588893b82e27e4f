"""Quintic Newton-Schulz orthogonalisation, optionally with every GEMM operand in NVFP4.

Run naively in NVFP4 the iteration diverges: near convergence X Xᵀ is mostly diagonal, a 1x16
block's scale is set by the diagonal entry and the small off-diagonal entries (which carry the
non-orthogonality) are flushed, and quantization noise pushes singular values above ~1.27, which
the quintic amplifies. Two guards keep it stable: the diagonal parts are applied exactly in fp32
(only off-diagonal products go through FP4 GEMMs), and each step caps the Gram's top eigenvalue.

`newton_schulz_batched` runs a stack of matrices of one shape together: every GEMM of a step is
one batched GEMM (bmm / baddbmm) for the stack, and each NVFP4 operand is quantized matrix by
matrix with its own global amax, exactly as one matrix's, in one pass for the stack
(`api.quantize_units`); a single matrix is the 2-D case of the same functions, with its own
(mm / mv) calls.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch import Tensor

from ..api import quantize_units
from ..formats.global_scale import global_decode_scale
from ..formats.spec import QuantSpec

# Keller Jordan's quintic: its slope at zero is a = 3.4445, so five steps lift singular values
# from ~1e-3 of the norm into roughly [0.7, 1.2] without converging exactly to 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# RNE for the Newton-Schulz operands (they are forward-like GEMM inputs); no NaN check on the hot
# path: a non-finite gradient propagates, as in torch.optim.Muon.
NS_SPEC = QuantSpec(nan_policy="propagate")
# With NVFP4 operands, X is scaled so its top singular value stays <= CAP: the quintic maps
# (0, 1.2] into (0, 1.2023] but diverges above ~1.27. 1.2 gave the lowest error among 1.1-1.25.
CAP = 1.2
# Power iterations for the Gram's top eigenvalue: with eigenvalues clustered near 1, 8 of them
# underestimated it by up to 13%, 16 by up to 6% (from one start vector).
POWER_ITERS = 16
_NS_DTYPES = (torch.bfloat16, torch.float32)


def _gemm(left: Tensor, right: Tensor, bias: Tensor | None = None, *,
          alpha: float = 1.0, beta: float = 1.0) -> Tensor:
    """alpha * left @ right + beta * bias: the one place Newton-Schulz multiplies (matrices,
    or stacks [B, m, k] @ [B, k, n] as one batched GEMM)."""
    if left.dim() == 3:
        if bias is None:
            return torch.bmm(left, right)
        return torch.baddbmm(bias, left, right, beta=beta, alpha=alpha)
    if bias is None:
        return torch.mm(left, right)
    return torch.addmm(bias, left, right, beta=beta, alpha=alpha)


class Operand(NamedTuple):
    """An NVFP4 GEMM operand split as units (E2M1 value x E4M3 block scale) and the tensor's
    decode scale (0-d; [B, 1, 1] for a stack, one per matrix): its values are units * dec,
    rounded once. Units have at most 6 significant bits, so they are exact in fp32, TF32 and
    BF16, and so are their products."""

    units: Tensor
    dec: Tensor

    @property
    def T(self) -> Operand:  # noqa: N802 (as Tensor.T)
        return Operand(self.units.mT, self.dec)

    def values(self) -> Tensor:
        return self.units * self.dec


def _operand(x: Tensor, spec: QuantSpec, reduce_dim: int) -> Operand:
    """x as an NVFP4 GEMM operand with blocks along `reduce_dim` (0: a right operand, quantized
    through its transpose, "column-wise"); a stack [B, m, n] matrix by matrix, each with its
    own global amax (the same quantizations as B separate calls), in one pass."""
    if reduce_dim == 0:
        return _operand(x.mT, spec, 1).T
    units, amax = quantize_units(x, spec)
    dec = global_decode_scale(amax, spec.scale_max)
    return Operand(units, dec[:, None, None] if x.dim() == 3 else dec)


@contextlib.contextmanager
def _tf32(device: torch.device):
    """CUDA fp32 GEMMs on TF32 tensor cores inside the block. Exact for operands of units:
    their <= 6 significant bits fit TF32's 11, and the products accumulate in fp32."""
    if device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    # torch >= 2.9 names the setting fp32_precision; allow_tf32 is the older spelling.
    name, value = (("fp32_precision", "tf32") if hasattr(matmul, "fp32_precision")
                   else ("allow_tf32", True))
    old = getattr(matmul, name)
    setattr(matmul, name, value)
    try:
        yield
    finally:
        setattr(matmul, name, old)


def _nvfp4_gemm(left: Operand, right: Operand) -> Tensor:
    """left @ right in fp32 from two NVFP4 operands: the GEMM of their units (exact products,
    fp32 accumulation; TF32 tensor cores on CUDA), times both decode scales."""
    with _tf32(left.units.device):
        out = _gemm(left.units, right.units)
    return out * (left.dec * right.dec)


def _top_eigenvalue(gram: Tensor, iters: int = POWER_ITERS) -> Tensor:
    """Estimate of the largest eigenvalue of a PSD matrix (0-d), or of each matrix of a stack
    [B, n, n] (as [B, 1, 1]): power iteration in fp32 from two start vectors (all ones, and
    alternating signs), the larger Rayleigh quotient; no host sync.

    A matrix runs as a stack of one and every product is a batched GEMM of two columns: one
    launch for the whole stack (a stack's matvecs matrix by matrix were most of Muon4's
    launches), and a matrix's estimate is the same alone or in a stack wherever bmm computes
    each matrix as it would alone (the CPU's, tested; with one column it does not). That
    matters: where the cap is active, one ulp of the estimate changes every FP4 rounding
    after it."""
    stack = gram if gram.dim() == 3 else gram[None]
    b, n = stack.shape[:2]
    signs = torch.ones(n, 2, dtype=stack.dtype, device=stack.device)
    signs[1::2, 1] = -1.0
    v = signs.expand(b, n, 2)
    for _ in range(iters):
        v = torch.bmm(stack, v)
        norms = torch.bmm(v.mT, v).diagonal(dim1=-2, dim2=-1).sqrt()  # [B, 2]
        v = v / norms.clamp(min=1e-30)[:, None, :]
    rayleigh = torch.bmm(v.mT, torch.bmm(stack, v)).diagonal(dim1=-2, dim2=-1)
    top = rayleigh.amax(-1)
    return top[:, None, None] if gram.dim() == 3 else top.reshape(())


def _split_diagonal(m: Tensor) -> tuple[Tensor, Tensor]:
    d = m.diagonal(dim1=-2, dim2=-1)
    return d, m - torch.diag_embed(d)


def _plain_step(x: Tensor, a: float, b: float, c: float) -> Tensor:
    """One quintic step in x's dtype: torch.optim.Muon's operations, in its order."""
    gram = _gemm(x, x.mT)
    poly = _gemm(gram, gram, gram, alpha=c, beta=b)
    return _gemm(poly, x, x, beta=a)


def _nvfp4_step(x: Tensor, spec: QuantSpec, a: float, b: float, c: float) -> Tensor:
    """One quintic step with NVFP4 GEMM operands (fp32 accumulation, fp32 in between).

    Two guards keep FP4 noise from blowing the iteration up (naively, five steps diverge):
    - the Gram of a near-orthogonal X is diagonal-heavy, and in a 1x16 block the diagonal
      entry sets the scale, flushing the off-diagonal entries that carry the non-orthogonality.
      So A = D + O and P = aI + bA + cA² = D_P + O_P are split: the diagonal parts act as exact
      fp32 row/column scalings and only O·O and O_P·X run as FP4 GEMMs;
    - NVFP4 X perturbs the Gram's spectrum by ~10-20%, and the quintic diverges for singular
      values above ~1.27. X is scaled down whenever the Gram's top eigenvalue estimate exceeds
      CAP² (noise-free iterates stay below CAP, so then this is a no-op).
    """
    xq = _operand(x, spec, 1)
    gram = _nvfp4_gemm(xq, xq.T)  # reduces over X's columns: X row-wise on both sides
    scale = (_top_eigenvalue(gram).clamp(min=0).sqrt() / CAP).clamp(min=1.0)
    x, gram = x / scale, gram / scale**2
    d, off = _split_diagonal(gram)
    square = _nvfp4_gemm(_operand(off, spec, 1), _operand(off, spec, 0))  # O·O: over O's cols
    square = (square + d[..., :, None] * off + off * d[..., None, :]
              + torch.diag_embed(d * d))  # (D + O)²
    eye = torch.eye(d.shape[-1], dtype=gram.dtype, device=gram.device)
    poly = c * square + b * gram + a * eye
    pd, poff = _split_diagonal(poly)
    return pd[..., :, None] * x + _nvfp4_gemm(_operand(poff, spec, 1),
                                              _operand(x, spec, 0))  # X rows


def newton_schulz(
    g: Tensor,
    steps: int = 5,
    spec: QuantSpec | None = None,
    eps: float = 1e-7,
    *,
    dtype: torch.dtype = torch.bfloat16,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
) -> Tensor:
    """The quintic Newton-Schulz orthogonalisation of a matrix g, returned in `dtype`.

    X = g / ||g||_F (transposed if tall, so the Gram matrix is the small side), then `steps` times
    X <- aX + (bA + cA²)X with A = XXᵀ. X is rounded to `dtype` after every step.

    spec=None: every GEMM runs natively in `dtype`; with bf16 (the default) this is
    torch.optim.Muon's arithmetic bit for bit. With a spec every GEMM operand is NVFP4 along that
    GEMM's reduction dim (the right operand column-wise, with its own amax) and accumulates in
    fp32: A = Q(X)Q(X)ᵀ reduces over X's columns; A's off-diagonal part squared, O·O, reduces
    over O's shared dim; the off-diagonal part of the polynomial times X reduces over X's rows.
    See _nvfp4_step for the diagonal split and the spectral cap this needs to stay stable.
    """
    if g.dim() != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(g.shape)}; a "
                         "stack of matrices of one shape: newton_schulz_batched")
    return _iterate(g, steps, spec, eps, dtype, coefficients)


def newton_schulz_batched(
    g: Tensor,
    steps: int = 5,
    spec: QuantSpec | None = None,
    eps: float = 1e-7,
    *,
    dtype: torch.dtype = torch.bfloat16,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
) -> Tensor:
    """`newton_schulz` of each matrix of a stack g [B, rows, cols], all at once: each GEMM of a
    step is one batched GEMM over the stack, each NVFP4 operand is quantized per matrix (its own
    global amax, the operands of B separate calls bit for bit), the norms, power iterations and
    spectral caps are per matrix. Where bmm computes each matrix of a stack as mm does (the
    CPU's, tested), the results are those of B calls."""
    if g.dim() != 3:
        raise ValueError(f"newton_schulz_batched needs a stack [B, rows, cols], got shape "
                         f"{tuple(g.shape)}; one matrix: newton_schulz")
    return _iterate(g, steps, spec, eps, dtype, coefficients)


def _iterate(g: Tensor, steps: int, spec: QuantSpec | None, eps: float, dtype: torch.dtype,
             coefficients: tuple[float, float, float]) -> Tensor:
    """newton_schulz of a matrix, or of each matrix of a stack [B, rows, cols]."""
    if not isinstance(steps, int) or not 0 <= steps < 100:
        raise ValueError(f"steps must be an int in [0, 100), got {steps!r}")
    if not g.is_floating_point():
        raise ValueError(f"newton_schulz needs a floating matrix, got {g.dtype}")
    if spec is not None and dtype not in _NS_DTYPES:
        raise ValueError(f"with a spec, dtype must be one of {_NS_DTYPES}, got {dtype}")
    x = g.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    # spectral norm <= Frobenius norm <= 1
    norm = (x.norm() if x.dim() == 2
            else torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True))
    x = x / norm.clamp(min=eps)
    for _ in range(steps):
        if spec is None:
            x = _plain_step(x, *coefficients)
        else:
            x = _nvfp4_step(x.float(), spec, *coefficients).to(dtype)
    return x.mT if tall else x


def replayable(spec: QuantSpec | None) -> bool:
    """Whether a graph replay of newton_schulz with `spec` repeats the eager call: not with
    stochastic rounding, whose seed is drawn on the host at each call (a graph would freeze
    the capture's draws)."""
    return spec is None or spec.rounding != "stochastic"


class GraphedNewtonSchulz:
    """newton_schulz replayed from CUDA graphs, one per (shape, dtype, steps, spec, ...); a
    stack [B, rows, cols] is newton_schulz_batched's, captured once for the whole stack.

    One NS call is some 70 small kernels per step (the NVFP4 one ~350 in five steps: operand
    quantizers, power iterations, diagonal splits), so on a GPU a step of Muon over a model's
    matrices is bound by kernel launches; a replay issues them all at once. The kernels and
    their inputs are those of the eager call, so the result is the eager one bit for bit (tested
    on a GPU). Off CUDA, while a graph is being captured, or with stochastic rounding (see
    `replayable`), it calls newton_schulz.

    The returned tensor is the graph's static output: the next call with the same key
    overwrites it, so consume it first (Muon4 adds it into the weight at once). All graphs share
    one memory pool, as they run one after another.
    """

    def __init__(self) -> None:
        self._graphs: dict[tuple, tuple[Tensor, Tensor, torch.cuda.CUDAGraph]] = {}
        self._pool = None

    def __call__(self, g: Tensor, steps: int = 5, spec: QuantSpec | None = None, *,
                 dtype: torch.dtype = torch.bfloat16,
                 coefficients: tuple[float, float, float] = NS_COEFFICIENTS) -> Tensor:
        if (g.device.type != "cuda" or torch.cuda.is_current_stream_capturing()
                or not replayable(spec)):
            return orthogonalize(g, steps, spec, dtype=dtype, coefficients=coefficients)
        key = (tuple(g.shape), g.dtype, g.device, steps, spec, dtype, tuple(coefficients))
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(g, steps, spec, dtype, coefficients)
        static_in, static_out, graph = entry
        static_in.copy_(g)
        graph.replay()
        return static_out

    def _capture(self, g: Tensor, steps: int, spec: QuantSpec | None, dtype: torch.dtype,
                 coefficients: tuple[float, float, float]):
        static_in = g.detach().clone()
        # Warm-up off the capture (Triton compiles, cuBLAS creates its workspace), on a side
        # stream as torch.cuda.graph's capture runs on one.
        side = torch.cuda.Stream(g.device)
        side.wait_stream(torch.cuda.current_stream(g.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                orthogonalize(static_in, steps, spec, dtype=dtype, coefficients=coefficients)
        torch.cuda.current_stream(g.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            static_out = orthogonalize(static_in, steps, spec, dtype=dtype,
                                    coefficients=coefficients)
        self._pool = graph.pool()
        return static_in, static_out, graph


def orthogonalize(g: Tensor, *args, **kwargs) -> Tensor:
    """newton_schulz of a matrix, newton_schulz_batched of a stack [B, rows, cols]."""
    return (newton_schulz_batched if g.dim() == 3 else newton_schulz)(g, *args, **kwargs)
