"""ROOT and ROOT4 (arXiv 2511.20626): shape-adaptive Newton-Schulz coefficients and the
soft-threshold of outliers, as options of Muon4. Checked against a float64 ROOT step written
plainly here (the reference code's momentum form and torch.quantile), against SVD, and the NVFP4
operands of ROOT4 against the reference quantizer."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from ns_reference import top_eigenvalue

import fp4stack.optim.newton_schulz as ns
from fp4stack import fake_quantize
from fp4stack.analysis.sample_models import text_batch
from fp4stack.models import GPT, GPTConfig
from fp4stack.optim import ROOT, ROOT4, AdamW4, Muon4, StateFormat
from fp4stack.optim.muon4 import NS_SPEC
from fp4stack.optim.muon_params import split_params
from fp4stack.optim.root_ns import (
    ROOT_TABLE,
    clip_outliers,
    mp_singular_values,
    ns_coefficients,
    outlier_threshold,
    quintic,
    root_coefficients,
)

MUON = (3.4445, -4.7750, 2.0315)
pytestmark = pytest.mark.usefixtures("one_thread")


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def heavy(*shape: int, seed: int = 0) -> torch.Tensor:
    """Gaussian entries with a few 50x outliers, as gradients have."""
    g = randn(*shape, seed=seed)
    mask = torch.rand(*shape, generator=torch.Generator().manual_seed(seed + 1)) < 0.01
    return torch.where(mask, 50 * g, g)


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


# ---------------------------------------------------------------- the float64 reference


def soft_threshold(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.sign(x) * torch.relu(x.abs() - eps)


def ns64(x: torch.Tensor, coefficients, steps: int = 5) -> torch.Tensor:
    a, b, c = coefficients
    if x.shape[0] > x.shape[1]:
        return ns64(x.T, coefficients, steps).T
    x = x / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def root_reference(w, grads, lr=0.02, mu=0.95, wd=0.0, q=0.9):
    """ROOT as the paper's algorithm and its reference code write it, in float64: M <- mu M + G,
    U = G + mu M (Nesterov), eps = quantile(|U|, q), B = U - T_eps(U), W <- W(1 - lr wd) -
    lr sqrt(max(1, rows / cols)) NS_root(B)."""
    w = w.double().clone()
    m = torch.zeros_like(w)
    rows, cols = w.shape
    coefficients = root_coefficients(rows, cols)
    for g in grads:
        g = g.double()
        m = mu * m + g
        u = g + mu * m
        eps = torch.quantile(u.abs().flatten(), q).item()
        b = u - soft_threshold(u, eps) if eps > 0 else u
        w = w * (1 - lr * wd) - lr * math.sqrt(max(1.0, rows / cols)) * ns64(b, coefficients)
    return w


# ---------------------------------------------------------------- soft-threshold


@pytest.mark.parametrize("q", [0.5, 0.9, 0.999, 1.0])
@pytest.mark.parametrize("shape", [(7, 13), (64, 64)])
def test_threshold_is_torch_quantile(q, shape):
    u = heavy(*shape)
    ref = torch.quantile(u.abs().double().flatten(), q).item()
    assert outlier_threshold(u, q).item() == pytest.approx(ref, rel=1e-6)


@given(values=st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=64),
       q=st.floats(0.01, 1.0))
def test_clipped_plus_soft_threshold_is_the_input(values, q):
    # B + T_eps(U) = U wherever eps > 0, |B| <= eps, signs kept, and it is odd: B(-U) = -B(U).
    u = torch.tensor(values, dtype=torch.float32).reshape(1, -1)
    eps = outlier_threshold(u, q).item()
    b = clip_outliers(u, q)
    if eps > 0:
        assert torch.allclose(b.double() + soft_threshold(u.double(), eps), u.double(),
                              atol=1e-4 * max(1.0, eps))
        assert (b.abs() <= eps).all()
    else:
        assert torch.equal(b, u)
    assert torch.equal(clip_outliers(-u, q), -b)
    assert ((b == 0) | (torch.sign(b) == torch.sign(u))).all()


def test_threshold_edge_cases():
    u = heavy(16, 32)
    assert torch.equal(clip_outliers(u, 1.0), u)  # the max: nothing clipped
    zeros = torch.zeros(8, 8)
    assert torch.equal(clip_outliers(zeros, 0.9), zeros)
    # 95% zeros: the 0.9-quantile is 0; the matrix is kept as it is, not wiped out.
    sparse = torch.zeros(10, 10)
    sparse[0, :5] = torch.tensor([1.0, -2.0, 3.0, 100.0, -0.5])
    assert torch.equal(clip_outliers(sparse, 0.9), sparse)
    # Scale-free: the clipped part of c u is c times that of u.
    assert torch.allclose(clip_outliers(8.0 * u, 0.9), 8.0 * clip_outliers(u, 0.9))
    # Exactly the top 10% of |u| are clipped, to the threshold.
    u = torch.arange(1.0, 101.0).reshape(10, 10)
    b = clip_outliers(u, 0.9)
    assert (b < u).sum() == 10 and b.max().item() == pytest.approx(90.1)


# ---------------------------------------------------------------- shape-adaptive coefficients


def test_published_shapes_use_the_table_and_others_are_fitted_once():
    for (m, n), coefficients in ROOT_TABLE.items():
        assert root_coefficients(m, n) == coefficients == root_coefficients(n, m)
    assert ns_coefficients("muon", 64, 256, 5) == MUON
    fitted = root_coefficients(64, 256)
    assert fitted != MUON and fitted == root_coefficients(256, 64)
    with pytest.raises(ValueError, match="ns_coefficients"):
        ns_coefficients("cans", 64, 64, 5)


def test_mp_singular_values_match_a_gaussian_matrix():
    # The model the fit uses, against the SVD of real Gaussian matrices of the shape.
    for shape in [(64, 256), (128, 128)]:
        s = torch.linalg.svdvals(randn(*shape, seed=5).double())
        s = (s / s.norm()).sort().values
        mp = mp_singular_values(*shape, points=min(shape))
        assert (mp - s).abs().max() < 0.2 * s.max()
        assert abs(mp.pow(2).sum().item() - 1) < 0.02  # Frobenius-normalised


@pytest.mark.parametrize("shape", [(64, 256), (96, 96), (48, 160), (256, 64)])
def test_root_coefficients_orthogonalise_better_than_muons(shape):
    """The point of shape-adaptive coefficients: a lower error against the exact polar factor
    U Vᵀ (SVD, float64) for matrices of that shape, here Gaussian ones (the fit's model) and
    heavy-tailed ones (not)."""
    for g in (randn(*shape, seed=7), heavy(*shape, seed=8)):
        u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
        polar = u @ vh
        ours = rel(ns64(g.double(), root_coefficients(*shape)), polar)
        muon = rel(ns64(g.double(), MUON), polar)
        print(shape, f"root {ours:.4f} muon {muon:.4f}")
        assert ours < 0.9 * muon


@pytest.mark.parametrize("shape", [(64, 256), (96, 96), (512, 2048), (1024, 1024)])
def test_fitted_iteration_stays_bounded(shape):
    # Any singular value in (0, 1] stays in (0, 1.25] for many more steps than five.
    s = torch.linspace(1e-6, 1.0, 5001, dtype=torch.float64)
    out = quintic(s, root_coefficients(*shape), 50)
    assert (out > 0).all() and out.max() <= 1.25


# ---------------------------------------------------------------- one ROOT step


@pytest.mark.parametrize("shape", [(48, 96), (96, 48), (64, 64)])
def test_root_matches_float64_reference(shape):
    w0 = randn(*shape, seed=1)
    grads = [heavy(*shape, seed=10 + t) for t in range(3)]
    p = torch.nn.Parameter(w0.clone())
    opt = ROOT([p], lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    for g in grads:
        p.grad = g
        opt.step()
    ref = root_reference(w0, grads, wd=0.1)
    # fp32 Newton-Schulz and fp32 weights (an ulp of W is ~4e-5 of a step): measured 1.3e-5.
    assert rel(p.detach() - w0, ref - w0.double()) < 1e-4
    # The check can fail: Muon's coefficients or no clipping land elsewhere.
    for kwargs in ({"ns_coefficients": "muon"}, {"outlier_quantile": None}):
        other = torch.nn.Parameter(w0.clone())
        opt = ROOT([other], lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, **kwargs)
        for g in grads:
            other.grad = g
            opt.step()
        assert rel(other.detach() - w0, ref - w0.double()) > 1e-3


def test_stacked_experts_clip_each_matrix_on_its_own():
    g = torch.stack([heavy(32, 48, seed=1), 100 * heavy(32, 48, seed=2)])
    w0 = randn(2, 32, 48)
    p = torch.nn.Parameter(w0.clone())
    opt = ROOT([p], ns_dtype=torch.float32)
    p.grad = g
    opt.step()
    for e in range(2):
        ref = root_reference(w0[e], [g[e]])
        assert rel(p.detach()[e] - w0[e], ref - w0[e].double()) < 1e-4


# ---------------------------------------------------------------- ROOT4


def q_rows(x: torch.Tensor) -> torch.Tensor:
    return fake_quantize(x.float().contiguous(), spec=NS_SPEC).double()


def nvfp4_ns64(g: torch.Tensor, coefficients, steps: int = 5, cap: float = 1.2) -> torch.Tensor:
    """Muon4's documented NVFP4 iteration in float64 between quantizations (tests/test_muon4.py's
    chain, with any coefficients)."""
    a, b, c = coefficients
    x = g.double()
    if x.shape[0] > x.shape[1]:
        return nvfp4_ns64(g.T, coefficients, steps, cap).T
    x = x / x.norm()
    for _ in range(steps):
        xq = q_rows(x)
        gram = xq @ xq.T
        scale = max(1.0, math.sqrt(top_eigenvalue(gram)) / cap)
        x, gram = x / scale, gram / scale**2
        off = gram - torch.diag(gram.diagonal())
        square = gram @ gram - off @ off + q_rows(off) @ q_rows(off.T).T
        poly = a * torch.eye(len(gram), dtype=x.dtype) + b * gram + c * square
        poly_off = poly - torch.diag(poly.diagonal())
        x = poly.diagonal()[:, None] * x + q_rows(poly_off) @ q_rows(x.T).T
    return x


def test_root4_operands_are_the_reference_quantizers_bits(monkeypatch):
    """Every NVFP4 operand ROOT4's Newton-Schulz multiplies is, value for value, fake_quantize
    of the matrix it stands for (blocks along the GEMM's reduction dim), and the first one is
    the clipped, normalised update."""
    seen: list[tuple[torch.Tensor, int, torch.Tensor]] = []
    real = ns._operand

    def spy(x, spec, reduce_dim):
        op = real(x, spec, reduce_dim)
        seen.append((x.detach().clone(), reduce_dim, op.values()))
        return op

    monkeypatch.setattr(ns, "_operand", spy)
    shape = (48, 96)
    g = heavy(*shape, seed=3)
    p = torch.nn.Parameter(randn(*shape))
    opt = ROOT4([p], ns_dtype=torch.float32, cuda_graphs=False)
    p.grad = g
    opt.step()
    # Five operands per step (X, O row- and column-wise, P's off-diagonal part, X column-wise);
    # the two column-wise ones record their inner call on the transpose too.
    assert len(seen) == 5 * 7
    for x, reduce_dim, values in seen:
        expected = fake_quantize(x.float().contiguous(), spec=NS_SPEC) if reduce_dim == 1 \
            else fake_quantize(x.T.float().contiguous(), spec=NS_SPEC).T
        assert torch.equal(values, expected)
    # Muon4's first update is (1 - mu) G + mu (1 - mu) G; clipped and normalised as in ROOT.
    u = clip_outliers(g * (1 - 0.95) * (1 + 0.95), 0.9)
    first = seen[0][0]
    assert rel(first, u / u.norm()) < 1e-6


@pytest.mark.parametrize("shape", [(48, 96), (96, 48)])
def test_root4_first_step_matches_the_float64_nvfp4_chain(shape):
    # The first step reads no quantized momentum: ROOT4's update is the NVFP4 Newton-Schulz of
    # the clipped update with ROOT's coefficients.
    w0 = randn(*shape, seed=4)
    g = heavy(*shape, seed=5)
    p = torch.nn.Parameter(w0.clone())
    opt = ROOT4([p], lr=0.02, ns_dtype=torch.float32, cuda_graphs=False)
    p.grad = g
    opt.step()
    b = clip_outliers(g.double(), 0.9)
    lr_adj = 0.02 * math.sqrt(max(1.0, shape[0] / shape[1]))
    ref = -lr_adj * nvfp4_ns64(b, root_coefficients(*shape))
    assert rel(p.detach() - w0, ref) < 1e-4


def test_root4_keeps_nvfp4_momentum_and_adamw4():
    shape = (32, 64)
    w, bias = torch.nn.Parameter(randn(*shape)), torch.nn.Parameter(torch.zeros(32))
    fmt = StateFormat(transform="sqrt-center-hadamard")
    opt = ROOT4([w], adamw_params=[bias], adamw_state_format=fmt)
    w.grad, bias.grad = randn(*shape, seed=1), randn(32, seed=2)
    opt.step()
    state = opt.state[w]
    assert state["momentum_data"].dtype == torch.uint8 and "momentum_buffer" not in state
    assert isinstance(opt.adamw, AdamW4) and opt.adamw.state_format == fmt
    plain = ROOT([torch.nn.Parameter(randn(*shape))])
    assert plain.quantize is False


def test_bad_root_options_raise():
    w = torch.nn.Parameter(randn(16, 16))
    for kwargs, match in (({"ns_coefficients": "x"}, "ns_coefficients"),
                          ({"outlier_quantile": 0.0}, "outlier_quantile"),
                          ({"outlier_quantile": 1.5}, "outlier_quantile"),
                          ({"outlier_quantile": True}, "outlier_quantile"),
                          ({"adamw_state_format": "sqrt"}, "adamw_state_format")):
        with pytest.raises(ValueError, match=match):
            Muon4([w], **kwargs)


def test_a_state_dict_saved_before_root_options_loads_as_muon():
    w = torch.nn.Parameter(randn(32, 48))
    opt = Muon4([w], quantize=False)
    w.grad = randn(32, 48, seed=1)
    opt.step()
    sd = opt.state_dict()
    for group in sd["param_groups"]:
        del group["ns_coefficients"], group["outlier_quantile"]
    opt2 = Muon4([w], quantize=False)
    opt2.load_state_dict(sd)
    opt2.step()  # no KeyError: the old groups are plain Muon


# ---------------------------------------------------------------- training


def train(model: GPT, opt, tokens: torch.Tensor, steps: int) -> list[float]:
    x, y = tokens[:, :-1], tokens[:, 1:]
    losses = []
    for _ in range(steps):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_tiny_gpt_trains_with_root_and_root4():
    """ROOT and ROOT4 train a tiny GPT like Muon does. Measured mean loss of steps 28-30 on this
    batch: Muon 0.819, ROOT 0.835, ROOT4 0.774."""
    tokens = text_batch(4 * 65, vocab_size=256).view(4, 65)
    final = {}
    for name, make in (("muon", Muon4), ("root", ROOT), ("root4", ROOT4)):
        torch.manual_seed(0)
        model = GPT(GPTConfig.tiny(n_layers=1))
        hidden, rest = split_params(model)
        kwargs = {"quantize": False} if name == "muon" else {}
        opt = make(hidden, lr=0.02, adamw_params=rest, adamw_lr=3e-3, **kwargs)
        final[name] = sum(train(model, opt, tokens, 30)[-3:]) / 3
    print(final)
    assert final["root"] < 1.1 * final["muon"], final
    assert final["root4"] < 1.15 * final["muon"], final
