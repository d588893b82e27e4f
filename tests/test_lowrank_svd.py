"""SVDQuant's split of a linear's weight (LowRank fit="weight", presets lowrank-svd*): W's
principal part L in high precision, only W - L quantized. Checked against a float64 reference of
the forward and of the backward (the gradient to W through both parts, written out by hand),
the refit schedule (eager and compiled), and that the split lowers the output and input-gradient
error of plain NVFP4 on weights with a dominant low-rank part."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from operand_reference import fq as fq_reference

import fp4stack
from fp4stack import LowRank, QuantLinear, Recipe, recipe
from fp4stack.convert import high_precision_recipe
from fp4stack.nn.attention_quant import AttentionQuant
from fp4stack.nn.lowrank import count_and_refresh
from fp4stack.nn.lowrank_split import principal_factors
from fp4stack.ops import spec_key

N, K, RANK = 48, 64, 4


def fq(t, spec, columnwise=False):
    """operand_reference.fq of t in float32 (as float64)."""
    return fq_reference(t if spec is None or spec.format == "none" else t.float(), spec,
                        columnwise)


def dominant(n=N, k=K, rank=RANK, seed=0, noise=0.02):
    """A weight whose spectrum has `rank` large singular values over a small noise floor."""
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(n, rank, generator=g, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(k, rank, generator=g, dtype=torch.float64)).Q
    s = torch.linspace(3.0, 1.5, rank, dtype=torch.float64)
    return ((u * s) @ v.t() + noise * torch.randn(n, k, generator=g, dtype=torch.float64)).float()


def data(tokens=40, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, K, generator=g)
    x[:, 5] *= 15  # an outlier channel
    return x, torch.randn(N, generator=g), torch.randn(tokens, N, generator=g)


def rne(r: Recipe) -> Recipe:
    fix = {f: dataclasses.replace(getattr(r, f), rounding="rne") for f in
           ("x", "w", "dy", "w_dgrad", "x_wgrad", "dy_wgrad")
           if getattr(r, f) is not None and getattr(r, f).rounding == "stochastic"}
    return r.with_(**fix)


def split_recipe(base: str, rank=RANK, every=0) -> Recipe:
    return rne(recipe(base)).with_(name=f"{base}-split",
                                   lowrank=LowRank(rank=rank, refresh_every=every, fit="weight"))


def layer_of(r: Recipe, w, b=None) -> QuantLinear:
    lin = torch.nn.Linear(K, N, bias=b is not None)
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    return QuantLinear.from_linear(lin, r)


def reference(x, w, b, dy, a, bb, r: Recipe):
    """y, dx, dW in float64 for y = x Lᵀ + Q(x) Q(W - L)ᵀ + b, L = P_B W P_A (P_B = B Bᵀ,
    P_A = Aᵀ A), with the recipe's quantizers on the residual's three GEMMs (straight through)
    and dW = P_B (dyᵀ x) P_A + G - P_B G P_A, G the residual GEMMs' dW."""
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    pa, pb = a.double().t() @ a.double(), bb.double() @ bb.double().t()
    low = pb @ w64 @ pa
    res = (w64 - low).float()
    qx, qr = fq(x, r.x), fq(res, r.w)
    y = x64 @ low.t() + qx @ qr.t() + (b.double() if b is not None else 0)
    r_dgrad = qr if r.w_dgrad is None else fq(res, r.w_dgrad, columnwise=True)
    dx = dy64 @ low + fq(dy, r.dy) @ r_dgrad
    x_wgrad = qx if r.x_wgrad is None else fq(x, r.x_wgrad, columnwise=True)
    g = fq(dy, r.dy_wgrad, columnwise=True).t() @ x_wgrad
    dw = pb @ (dy64.t() @ x64) @ pa + g - pb @ g @ pa
    return y, dx, dw


# ---- the randomized SVD ------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(48, 64), (200, 96), (96, 300)])
def test_principal_factors_span_the_top_singular_subspaces(shape):
    n, k = shape
    w = dominant(n, k, rank=8, seed=n)
    a, b = principal_factors(w, 8)
    assert a.shape == (8, k) and b.shape == (n, 8) and a.dtype == b.dtype == torch.float32
    eye = torch.eye(8, dtype=torch.float64)
    torch.testing.assert_close(a.double() @ a.double().t(), eye, atol=1e-5, rtol=0)
    torch.testing.assert_close(b.double().t() @ b.double(), eye, atol=1e-5, rtol=0)
    u, s, vh = torch.linalg.svd(w.double())
    best = (u[:, :8] * s[:8]) @ vh[:8]  # Eckart-Young: the best rank-8 approximation
    got = b.double() @ (b.double().t() @ w.double() @ a.double().t()) @ a.double()
    # A randomized SVD: near the best; its residual within 0.1% of the optimal one
    assert (got - best).norm() < 5e-3 * best.norm()
    assert (w.double() - got).norm() < 1.001 * (w.double() - best).norm()
    again = principal_factors(w, 8)  # a fixed seed: the same bits every refit
    assert torch.equal(again[0], a) and torch.equal(again[1], b)


def test_principal_factors_clip_the_rank_to_the_matrix():
    w = dominant(12, 20, rank=2)
    a, b = principal_factors(w, 40)
    assert a.shape == (12, 20) and b.shape == (12, 12)
    low = b.double() @ (b.double().t() @ w.double() @ a.double().t()) @ a.double()
    torch.testing.assert_close(low, w.double(), atol=1e-5, rtol=0)  # full rank: L is W


# ---- forward and backward against float64 --------------------------------------------------
@pytest.mark.parametrize("base", ["nvfp4", "nvfp4-4over6", "nvfp4-nvidia"])
@pytest.mark.parametrize("bias", [True, False])
def test_split_forward_and_backward_match_float64_reference(base, bias):
    x, b, dy = data()
    w = dominant()
    r = split_recipe(base)
    layer = layer_of(r, w, b if bias else None)
    xg = x.clone().requires_grad_(True)
    y = layer(xg)
    y.backward(dy)
    ry, rdx, rdw = reference(x, w, b if bias else None, dy, layer.lowrank_a, layer.lowrank_b, r)
    tol = dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(y.double(), ry, **tol)
    torch.testing.assert_close(xg.grad.double(), rdx, **tol)
    torch.testing.assert_close(layer.weight.grad.double(), rdw, **tol)
    if bias:
        torch.testing.assert_close(layer.bias.grad, dy.sum(0))
    # Not the plain recipe's numbers: the split changed all three.
    plain = layer_of(rne(recipe(base)), w, b if bias else None)
    xp = x.clone().requires_grad_(True)
    yp = plain(xp)
    yp.backward(dy)
    for got, other in ((y, yp), (xg.grad, xp.grad), (layer.weight.grad, plain.weight.grad)):
        assert not torch.allclose(got, other, rtol=1e-3, atol=1e-3)


def test_bf16_autocast_runs_the_principal_part_in_bf16_and_splits_in_fp32():
    x, b, dy = data(32)
    w = dominant()
    r = split_recipe("nvfp4")
    layer = layer_of(r, w, b)
    xg = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(xg)
    assert y.dtype == torch.bfloat16
    y.backward(dy.bfloat16())
    assert layer.weight.grad.dtype == torch.float32
    ry, rdx, rdw = reference(x, w, b, dy.bfloat16().float(), layer.lowrank_a, layer.lowrank_b, r)
    for got, want in ((y, ry), (xg.grad, rdx), (layer.weight.grad, rdw)):
        torch.testing.assert_close(got.double(), want, rtol=0,
                                   atol=2**-6 * float(want.abs().max()))


# ---- the refit schedule ----------------------------------------------------------------------
def moved(layer: QuantLinear, seed: int) -> None:
    with torch.no_grad():  # a step that turns W's principal directions
        layer.weight.copy_(dominant(seed=seed))


def test_refit_every_n_training_forwards_from_the_current_weight():
    x, _, _ = data()
    layer = layer_of(split_recipe("nvfp4", every=3), dominant()).train()
    first = (layer.lowrank_a.clone(), layer.lowrank_b.clone())
    assert all(torch.equal(f, g) for f, g in zip(first, principal_factors(dominant(), RANK),
                                                 strict=True))
    moved(layer, seed=5)
    layer.eval()(x)  # evaluation forwards are not counted
    layer.train()
    for n in (1, 2):
        layer(x)
        assert int(layer.lowrank_forwards) == n and torch.equal(layer.lowrank_a, first[0])
    layer(x)  # the third: refitted, from the moved weight, before it is used
    want = principal_factors(layer.weight, RANK)
    assert torch.equal(layer.lowrank_a, want[0]) and torch.equal(layer.lowrank_b, want[1])
    names = {n for n, _ in layer.named_parameters()}
    assert names == {"weight"}  # L is W's part, never a parameter of its own


def test_between_refits_the_principal_part_follows_the_weight():
    # L = P_B W P_A: with the bases fixed, a changed W changes L (the projection of the new W),
    # so the layer equals the reference on the new W with the old bases.
    x, _, dy = data()
    r = split_recipe("nvfp4", every=0)
    layer = layer_of(r, dominant())
    moved(layer, seed=9)
    y = layer(x)
    want, _, _ = reference(x, layer.weight.detach(), None, dy, layer.lowrank_a,
                           layer.lowrank_b, r)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("every", [1, 2])
def test_the_refit_op_fits_the_weight_for_a_split(every):
    w = dominant()
    spec = recipe("nvfp4").w
    a0, b0 = torch.zeros(RANK, K), torch.zeros(N, RANK)
    args = (torch.zeros((), dtype=torch.int64), a0.clone(), b0.clone(), w, every,
            spec_key(spec), "weight")
    torch.library.opcheck(count_and_refresh, args)
    count, a, b = torch.zeros((), dtype=torch.int64), a0.clone(), b0.clone()
    want = principal_factors(w, RANK)
    for n in (1, 2):
        count_and_refresh(count, a, b, w, every, spec_key(spec), "weight")
        refit = n >= every
        assert torch.equal(a, want[0] if refit else a0) and torch.equal(b, want[1] if refit
                                                                        else b0)


def test_compiled_split_steps_give_eager_bits_and_refit_in_the_graph():
    def steps(compiled: bool):
        torch.manual_seed(0)
        layer = layer_of(split_recipe("nvfp4", every=2), dominant()).train()
        x, _, dy = data()
        fn = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
        out = []
        for seed in (3, 4, 5):
            y = fn(x)
            y.backward(dy)
            out += [y.detach(), layer.weight.grad.clone(), layer.lowrank_a.clone()]
            with torch.no_grad():  # a large step, so that the refit sees a new W
                layer.weight.add_(dominant(seed=seed) - layer.weight)
                layer.weight.grad = None
        assert int(layer.lowrank_forwards) == 3
        return out
    eager, compiled = steps(False), steps(True)
    assert all(torch.equal(e, c) for e, c in zip(eager, compiled, strict=True))
    assert not torch.equal(eager[2], eager[5])  # the second forward refitted


# ---- what the split is for -------------------------------------------------------------------
@pytest.mark.parametrize(("split", "plain"), [("lowrank-svd", "nvfp4"),
                                              ("lowrank-svd-4over6", "nvfp4-4over6")])
def test_split_lowers_output_and_input_gradient_error_on_a_dominant_low_rank_weight(split,
                                                                                      plain):
    for seed in range(3):
        w = dominant(seed=seed)
        x, _, dy = data(64, seed=seed + 10)
        exact_y, exact_dx = x.double() @ w.double().t(), dy.double() @ w.double()
        errors = {}
        for name in (split, plain):
            r = recipe(name)
            if r.lowrank is not None:
                r = r.with_(lowrank=dataclasses.replace(r.lowrank, rank=RANK))
            layer, xg = layer_of(r, w), x.clone().requires_grad_(True)
            y = layer(xg)
            y.backward(dy)
            errors[name] = ((y.double() - exact_y).norm() / exact_y.norm(),
                            (xg.grad.double() - exact_dx).norm() / exact_dx.norm())
        assert errors[split][0] < 0.7 * errors[plain][0], (seed, errors)
        assert errors[split][1] < 0.7 * errors[plain][1], (seed, errors)


# ---- the recipes ---------------------------------------------------------------------------
def test_presets_are_the_paper_forms():
    four_six = fp4stack.QuantSpec(four_over_six=True, nan_policy="propagate")
    base = recipe("nvfp4-4over6")
    assert all(getattr(base, f) == four_six for f in ("x", "w", "dy", "w_dgrad", "x_wgrad",
                                                      "dy_wgrad"))
    split = LowRank(refresh_every=4000, fit="weight")
    assert recipe("lowrank-svd") == recipe("nvfp4").with_(name="lowrank-svd", lowrank=split)
    assert recipe("lowrank-svd-4over6") == base.with_(name="lowrank-svd-4over6", lowrank=split)
    assert recipe("fullstack-paper") == base.with_(
        name="fullstack-paper", lowrank=split, optimizer_states="nvfp4",
        adamw4_transform="sqrt-center-hadamard", attention=AttentionQuant.qk_ds())
    assert recipe({"preset": "nvfp4", "name": "mine", "lowrank": {"fit": "weight"}}).lowrank == \
        LowRank(fit="weight")
    # A precision switch drops the split with the quantization (W = L + (W - L) exactly).
    assert high_precision_recipe(recipe("lowrank-svd")).lowrank is None


@pytest.mark.parametrize(("make", "match"), [
    (lambda: LowRank(fit="svd"), "LowRank.fit must be one of"),
    (lambda: LowRank(fit="weight", trainable=True), "trainable=True trains a branch"),
    (lambda: Recipe("r", lowrank=LowRank(fit="weight")), "needs an NVFP4"),
    (lambda: recipe("w4a4").with_(lowrank=LowRank(fit="weight")), "weight_storage='master'"),
    (lambda: recipe({"preset": "lowrank-svd", "name": "x", "lowrank": {"fitt": "weight"}}),
     r"recipe\.lowrank\.fitt: unknown field \(did you mean 'fit'"),
])
def test_bad_splits_are_refused_naming_the_field(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_a_split_layer_is_not_packed():
    layer = layer_of(split_recipe("nvfp4"), dominant())
    with pytest.raises(ValueError, match="cannot be packed"):
        layer.pack()
