"""Newton-Schulz batched over a stack of matrices of one shape (newton_schulz_batched) and
Muon4's batched_ns, against the per-matrix path.

The stack's NVFP4 operands must be the per-matrix operands bit for bit (each matrix quantized
with its own global amax), checked against fp4stack.fake_quantize of each matrix. The GEMMs are
one bmm / baddbmm per GEMM of a step; on this CPU bmm sums as mm does (checked first), so both
iterations repeat the per-matrix bits. The NVFP4 iteration's spectral cap comes from a power
iteration of two columns, a lone matrix's as a stack of one: a stack's one-column matvecs
round otherwise than a matrix's here (relative 1e-7 to 4e-7 on the estimate), and a one-ulp
change of the cap flips FP4 roundings that the iteration then carries (bf16 outputs differed by
up to 20% relative), so the premise is checked for both widths.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp4stack.optim.newton_schulz as ns
from fp4stack import fake_quantize
from fp4stack.optim import ROOT4, Muon4
from fp4stack.optim.muon4 import NS_SPEC

pytestmark = pytest.mark.usefixtures("one_thread")
SHAPES = [(32, 64), (64, 32), (48, 48), (40, 72)]  # wide, tall, square, not multiples of 16


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def stack(shape, n: int = 4, seed: int = 0) -> torch.Tensor:
    """n matrices of very different scales and one with an outlier column (distinct amaxes)."""
    g = randn(n, *shape, seed=seed)
    return g * torch.logspace(-3, 1, n)[:, None, None] + (torch.arange(shape[1]) == 0) * 20.0


def ns_float64(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The plain quintic in float64 on each matrix of a stack, written independently."""
    a, b, c = ns.NS_COEFFICIENTS
    x = g.double()
    tall = x.shape[-2] > x.shape[-1]
    x = x.mT if tall else x
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def rel(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative Frobenius distance of each matrix."""
    d = torch.linalg.vector_norm(x.double() - ref.double(), dim=(-2, -1))
    return d / torch.linalg.vector_norm(ref.double(), dim=(-2, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bmm_sums_as_mm_here(dtype):
    # The premise of the bit-for-bit tests below: on this CPU a batched GEMM of a stack gives
    # each matrix's mm / addmm bits.
    a, b, c = randn(3, 40, 72, seed=1).to(dtype), randn(3, 72, 40, seed=2).to(dtype), \
        randn(3, 40, 40, seed=3).to(dtype)
    assert torch.equal(torch.bmm(a, b), torch.stack([x @ y for x, y in zip(a, b, strict=True)]))
    want = torch.stack([torch.addmm(z, x, y, beta=-0.5, alpha=2.0)
                        for x, y, z in zip(a, b, c, strict=True)])
    assert torch.equal(torch.baddbmm(c, a, b, beta=-0.5, alpha=2.0), want)
    # ...and the power iteration's products of two columns each matrix's alone.
    grams, v = torch.bmm(a, a.mT), randn(3, 40, 2, seed=4).to(dtype)
    alone = torch.cat([torch.bmm(g[None], x[None]) for g, x in zip(grams, v, strict=True)])
    assert torch.equal(torch.bmm(grams, v), alone)


def test_power_iteration_of_a_stack_is_each_matrixs():
    grams = (lambda x: x @ x.mT)(stack((40, 72)))
    got = ns._top_eigenvalue(grams)
    assert got.shape == (4, 1, 1)
    assert torch.equal(got.flatten(), torch.stack([ns._top_eigenvalue(g) for g in grams]))
    want = torch.linalg.eigvalsh(grams.double())[:, -1]
    assert (got.flatten().double() <= want * (1 + 1e-5)).all()  # a Rayleigh quotient
    assert torch.allclose(got.flatten().double(), want, rtol=0.06)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduce_dim", [0, 1])
def test_stack_operands_are_each_matrixs_own(shape, reduce_dim):
    x = stack(shape)
    got = ns._operand(x, NS_SPEC, reduce_dim)
    singles = [ns._operand(m, NS_SPEC, reduce_dim) for m in x]
    assert torch.equal(got.units, torch.stack([s.units for s in singles]))
    assert torch.equal(got.dec, torch.stack([s.dec for s in singles])[:, None, None])
    assert len(set(got.dec.flatten().tolist())) == len(x)  # one amax per matrix
    for m, values in zip(x, got.values(), strict=True):  # the reference quantizer's values
        want = (fake_quantize(m.mT.contiguous(), spec=NS_SPEC).mT if reduce_dim == 0
                else fake_quantize(m.contiguous(), spec=NS_SPEC))
        assert torch.equal(values, want)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_batched_gives_the_per_matrix_bits(shape, dtype):
    x = stack(shape)
    want = torch.stack([ns.newton_schulz(m, dtype=dtype) for m in x])
    assert torch.equal(ns.newton_schulz_batched(x, dtype=dtype), want)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_batched_gives_the_per_matrix_bits(shape, dtype):
    x = stack(shape)
    want = torch.stack([ns.newton_schulz(m, spec=NS_SPEC, dtype=dtype) for m in x])
    assert torch.equal(ns.newton_schulz_batched(x, spec=NS_SPEC, dtype=dtype), want)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_batched_is_as_close_to_float64_as_per_matrix(shape, dtype):
    x = stack(shape, n=6, seed=4)
    ref = ns_float64(x)
    per = rel(torch.stack([ns.newton_schulz(m, spec=NS_SPEC, dtype=dtype) for m in x]), ref)
    got = rel(ns.newton_schulz_batched(x, spec=NS_SPEC, dtype=dtype), ref)
    assert (got < 0.45).all() and (per < 0.45).all()  # FP4 Newton-Schulz's own error band
    assert (got - per).abs().max() < 0.01


def test_shapes_are_refused_with_the_other_function_named():
    with pytest.raises(ValueError, match="newton_schulz_batched"):
        ns.newton_schulz(torch.ones(2, 4, 4))
    with pytest.raises(ValueError, match="one matrix: newton_schulz"):
        ns.newton_schulz_batched(torch.ones(4, 4))
    with pytest.raises(ValueError, match="batched_ns"):
        Muon4([nn.Parameter(torch.ones(4, 4))], batched_ns=1)


def test_graphed_off_cuda_is_the_eager_batched_call():
    x = stack((24, 40))
    graphed = ns.GraphedNewtonSchulz()
    assert torch.equal(graphed(x, 5, NS_SPEC, dtype=torch.float32),
                       ns.newton_schulz_batched(x, 5, NS_SPEC, dtype=torch.float32))
    assert not graphed._graphs


def params():
    """Matrices of three shapes, a 3-D expert stack sharing one of them, and a lone shape."""
    shapes = [(32, 48), (48, 32), (32, 48), (3, 32, 48), (48, 32), (16, 64)]
    return [nn.Parameter(randn(*s, seed=i) * 0.1) for i, s in enumerate(shapes)]


def run(make, steps: int = 3):
    ps = params()
    opt = make(ps)
    for step in range(steps):
        for i, p in enumerate(ps):
            p.grad = randn(*p.shape, seed=100 * step + i) * 1e-2
        opt.step()
    return [p.detach() for p in ps], opt


@pytest.mark.parametrize("kind", ["muon", "muon4", "root", "root4"])
def test_batched_step_is_the_per_matrix_step(kind):
    # The momentum's stochastic rounding draws from explicit seeds, the same in both runs.
    cls = ROOT4 if kind.startswith("root") else Muon4
    quantize = kind.endswith("4")

    def make(batched):
        return lambda ps: cls(ps, quantize=quantize, ns_dtype=torch.float32, cuda_graphs=False,
                              batched_ns=batched)

    (got, opt), (want, _) = run(make(True)), run(make(False))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert opt.batched_ns


def test_batched_step_batches_one_call_per_shape(monkeypatch):
    calls = []
    real = ns.newton_schulz_batched

    def spy(g, *args, **kwargs):
        calls.append(tuple(g.shape))
        return real(g, *args, **kwargs)

    monkeypatch.setattr(ns, "newton_schulz_batched", spy)
    run(lambda ps: Muon4(ps, cuda_graphs=False), steps=1)
    # (32, 48): two matrices and three experts; (48, 32) stored transposed as two; (16, 64)
    # alone takes the per-matrix call.
    assert sorted(calls) == [(2, 48, 32), (5, 32, 48)]
