"""QuantLinear against a float64 reference assembled from fake_quantize, for every recipe."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from operand_reference import fq

import fp4stack
from fp4stack import QuantLinear, QuantSpec, Recipe, ResidualCompensation, recipe
from fp4stack.nn import PRESETS
from fp4stack.nn.compensation import channel_energy
from fp4stack.nn.recipe import SCOPES

OPERANDS = ("x", "w", "dy", "w_dgrad", "x_wgrad", "dy_wgrad")
SCOPED = [f"{n}@{s}" for n in ("nvfp4", "nvfp4-nvidia", "fullstack-nvidia-noreuse") for s in SCOPES]
TRAINING = [n for n, r in PRESETS.items() if r.weight_storage == "master"] + SCOPED


def rne_only(r: Recipe) -> Recipe:
    """The recipe with stochastic rounding replaced by RNE (deterministic, for exact checks)."""
    fix = {}
    for f in OPERANDS:
        s = getattr(r, f)
        if s is not None and s.rounding == "stochastic":
            fix[f] = dataclasses.replace(s, rounding="rne")
    return r.with_(**fix)


def reference(x, w, b, dy, r: Recipe, dtype=torch.float64):
    """y, dx, dW in float64 from operands quantized in their own dtype and then rounded to
    `dtype` (the compute dtype: bf16 under autocast)."""
    def cast(t):
        return t.to(dtype).double()

    qx, qw = cast(fq(x, r.x)), cast(fq(w, r.w))
    y = qx @ qw.t() + cast(b)
    wd = qw if r.w_dgrad is None else cast(fq(w, r.w_dgrad, columnwise=True))
    dx = fq(dy, r.dy) @ wd
    xw = qx if r.x_wgrad is None else cast(fq(x, r.x_wgrad, columnwise=True))
    dw = fq(dy, r.dy_wgrad, columnwise=True).t() @ xw
    return y, dx, dw


def data(tokens=40, k=64, n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g)
    x[:, 3] *= 20  # an outlier channel
    return x, torch.randn(n, k, generator=g) * 0.1, torch.randn(n, generator=g), \
        torch.randn(tokens, n, generator=g)


@pytest.mark.parametrize("name", TRAINING)
@pytest.mark.parametrize("tokens", [32, 40])
def test_forward_and_backward_match_float64_reference(name, tokens):
    r = rne_only(recipe(name)).with_(lowrank=None)
    x, w, b, dy = data(tokens)
    layer = QuantLinear.from_linear(torch.nn.Linear(64, 48), r)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    xg = x.clone().requires_grad_(True)
    y = layer(xg)
    y.backward(dy)
    ry, rdx, rdw = reference(x, w, b, dy, r)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.double(), ry, **tol)
    torch.testing.assert_close(xg.grad.double(), rdx, **tol)
    torch.testing.assert_close(layer.weight.grad.double(), rdw, **tol)
    torch.testing.assert_close(layer.bias.grad, dy.sum(0))


@pytest.mark.parametrize("name", TRAINING)
def test_bf16_autocast_quantizes_fp32_masters_and_multiplies_in_bf16(name):
    # The GPU trainer's path: fp32 master weights, bf16 autocast, backward outside autocast.
    r = rne_only(recipe(name)).with_(lowrank=None)
    x, w, b, dy = data(32)
    layer = QuantLinear.from_linear(torch.nn.Linear(64, 48), r)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    xg = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(xg)
    assert y.dtype == torch.bfloat16
    y.backward(dy.bfloat16())
    assert xg.grad.dtype == layer.weight.grad.dtype == layer.bias.grad.dtype == torch.float32
    ry, rdx, rdw = reference(x, w, b, dy.bfloat16(), r, dtype=torch.bfloat16)
    # Only bf16 roundings of fp32 results remain (of the product, then of the bias sum).
    for got, want in ((y, ry), (xg.grad, rdx), (layer.weight.grad, rdw)):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2**-7 * float(want.abs().max()))


def test_quantized_recipes_change_the_numbers():
    # The reference check above could pass with quantization skipped by mistake: it must not.
    x, w, b, dy = data()
    _, _, plain = reference(x, w, b, dy, recipe("bf16"))
    for name in ("fp8", "nvfp4", "nvfp4-nvidia"):
        _, _, dw = reference(x, w, b, dy, rne_only(recipe(name)))
        assert not torch.allclose(dw, plain, rtol=1e-4, atol=1e-4), name


def test_stochastic_recipe_repeats_under_a_seed():
    x, w, b, dy = data()
    grads = []
    for _ in range(2):
        torch.manual_seed(7)
        layer = QuantLinear.from_linear(torch.nn.Linear(64, 48), "nvfp4-nvidia")
        layer(x).backward(dy)
        grads.append(layer.weight.grad)
    assert torch.equal(grads[0], grads[1])


def test_qat_w_weights_are_the_rollout_weights_bit_for_bit():
    lin = torch.nn.Linear(64, 48)
    trainer = QuantLinear.from_linear(lin, "qat-w")
    rollout = QuantLinear.from_linear(torch.nn.Linear(64, 48), "w4a4")
    rollout_src = torch.nn.Linear(64, 48)
    with torch.no_grad():
        rollout_src.weight.copy_(lin.weight)
    rollout = QuantLinear.from_linear(rollout_src, "w4a4")
    assert rollout.weight is None and rollout.packed_weight is not None
    assert torch.equal(trainer.quantized_weight().view(torch.int32),
                       rollout.quantized_weight().view(torch.int32))


def test_qat_w_gradient_is_straight_through():
    x, w, b, dy = data()
    layer = QuantLinear.from_linear(torch.nn.Linear(64, 48), "qat-w")
    xg = x.clone().requires_grad_(True)
    layer(xg).backward(dy)
    # Activations unquantized: dW = dyᵀ x exactly as for a plain layer (the quantizer is the
    # identity for the gradient), and dx uses the quantized weight the forward used.
    torch.testing.assert_close(layer.weight.grad, dy.t() @ x)
    torch.testing.assert_close(xg.grad, dy @ layer.quantized_weight())


def rc_layer(k) -> tuple[QuantLinear, torch.Tensor]:
    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 48)
    layer = QuantLinear.from_linear(lin, recipe("w4a4-rc").with_(
        compensation=ResidualCompensation(k=k)))
    return layer, lin


def test_compensating_every_channel_gives_the_trainer_forward():
    x, *_ = data()
    layer, _ = rc_layer(1.0)
    target = x @ layer.quantized_weight().t() + layer.bias
    torch.testing.assert_close(layer(x), target, rtol=1e-5, atol=1e-5)


def test_compensation_error_falls_monotonically_with_k():
    x, *_ = data()
    errors = []
    for k in (1, 2, 4, 8, 16, 32, 64):
        layer, _ = rc_layer(k)
        target = x @ layer.quantized_weight().t() + layer.bias
        errors.append(float((layer(x) - target).detach().norm()))
    assert all(a > b for a, b in zip(errors[:-1], errors[1:], strict=True)), errors
    assert errors[-1] < 1e-4 * errors[0]


def test_energy_selection_beats_random_channels():
    x, *_ = data()
    layer, _ = rc_layer(8)
    target = x @ layer.quantized_weight().t() + layer.bias
    chosen = float((layer(x) - target).detach().norm())
    qx = fp4stack.fake_quantize(x, spec=layer.recipe.x)
    qw = layer.quantized_weight()
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        c = torch.randperm(64, generator=g)[:8]
        y = qx @ qw.t() + (x - qx)[:, c] @ qw[:, c].t() + layer.bias
        assert chosen < float((y - target).detach().norm())
    # And it concentrates on the block holding the outlier channel (whose scale it sets).
    energy = channel_energy(x - qx, qw)
    assert int(energy.argmax()) < 16


def test_static_calibration_fixes_channels_and_amax():
    x, *_ = data()
    layer, _ = rc_layer(4)
    layer.recipe = layer.recipe.with_(
        compensation=ResidualCompensation(k=4, mode="static"), activation_amax="static")
    layer.start_calibration()
    layer(x)
    layer.finish_calibration()
    assert layer.rc_channels.shape == (4,)
    assert max(layer.rc_channels.tolist()) < 16  # the outlier's block carries the residual
    assert float(layer.x_amax) == float(x.abs().max())
    # Static channels and amax are used from now on: same output on the calibration batch as a
    # recipe that passes the same amax explicitly.
    qx = fp4stack.fake_quantize(x, spec=layer.recipe.x, amax=layer.x_amax)
    qw = layer.quantized_weight()
    c = layer.rc_channels
    want = qx @ qw.t() + (x - qx)[:, c] @ qw[:, c].t() + layer.bias
    torch.testing.assert_close(layer(x), want)


def test_lowrank_branch_reduces_weight_error_and_is_added():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    layer = QuantLinear.from_linear(lin, "lowrank")
    a, b = layer.lowrank_a, layer.lowrank_b
    err = lin.weight.detach() - layer.quantized_weight()
    assert (err - b @ a).norm() < 0.8 * err.norm()
    x, *_ = data()
    plain = QuantLinear.from_linear(lin, "nvfp4")
    torch.testing.assert_close(layer(x), plain(x) + (x @ a.t()) @ b.t())


def test_lowrank_refresh_follows_the_weight():
    layer = QuantLinear.from_linear(torch.nn.Linear(64, 48), recipe("lowrank").with_(
        lowrank=fp4stack.LowRank(rank=4, refresh_every=2)))
    before = layer.lowrank_a.clone()
    with torch.no_grad():
        layer.weight.mul_(3.0)
    x, *_ = data()
    layer.train()
    layer(x)
    assert torch.equal(layer.lowrank_a, before)
    layer(x)
    assert not torch.equal(layer.lowrank_a, before)


def test_packed_layer_holds_no_dequantized_copy():
    layer = QuantLinear.from_linear(torch.nn.Linear(64, 48), "w4a4")
    names = dict(layer.named_buffers())
    assert layer.weight is None and "weight" not in dict(layer.named_parameters())
    assert names["weight_data"].dtype == torch.uint8 and names["weight_data"].shape == (48, 32)
    assert names["weight_scales"].dtype == torch.float8_e4m3fn


def test_shared_weight_amax_is_used():
    layer = QuantLinear.from_linear(torch.nn.Linear(64, 48), "qat-w")
    shared = layer.weight.detach().abs().max() * 4
    layer.weight_amax = shared
    want = fp4stack.fake_quantize(layer.weight.detach(), spec=layer.recipe.w, amax=shared)
    assert torch.equal(layer.quantized_weight(), want)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(x=QuantSpec(hadamard=True)), "belongs on the wgrad operands"),
        (dict(x_wgrad=QuantSpec(hadamard=True)), "both use hadamard"),
        (dict(weight_storage="packed"), "needs an NVFP4 weight spec"),
        (dict(weight_storage="packed", w=QuantSpec(), w_dgrad=QuantSpec()), "w_dgrad as None"),
        (dict(compensation=ResidualCompensation()), "Recipe.x is not quantized"),
        (dict(keep_last_blocks=-1), "must be >= 0"),
    ],
)
def test_recipe_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Recipe("custom", **kwargs)


def test_unknown_recipe_and_bad_compensation():
    with pytest.raises(ValueError, match="unknown recipe 'nvfp5'"):
        recipe("nvfp5")
    with pytest.raises(ValueError, match="ResidualCompensation.k"):
        ResidualCompensation(k=0)
    with pytest.raises(ValueError, match="ResidualCompensation.k"):
        ResidualCompensation(k=1.5)


@pytest.mark.parametrize("name", ["w4a4", "w4a4-rc"])
def test_inference_recipes_forward_and_input_gradient(name):
    # Packed weights: y = Q(x) Q(W)ᵀ (+ the correction) and dx = dy Q(W), in float64 terms.
    x, w, b, dy = data()
    lin = torch.nn.Linear(64, 48)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    layer = QuantLinear.from_linear(lin, name)
    xg = x.clone().requires_grad_(True)
    y = layer(xg)
    y.backward(dy)
    r = recipe(name)
    qx, qw = fq(x, r.x), fq(w, r.w)
    want = qx @ qw.t() + b.double()
    if r.compensation is not None:
        residual = x.double() - qx
        c = torch.topk(channel_energy(residual, qw), r.compensation.count(64)).indices
        want = want + residual[:, c] @ qw[:, c].t()
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    if r.compensation is None:  # with compensation dx also flows through the residual term
        torch.testing.assert_close(xg.grad.double(), dy.double() @ qw, rtol=1e-5, atol=1e-5)


def test_trainable_lowrank_factors_get_gradients():
    layer = QuantLinear.from_linear(torch.nn.Linear(64, 48), recipe("lowrank").with_(
        lowrank=fp4stack.LowRank(rank=4, trainable=True)))
    assert isinstance(layer.lowrank_a, torch.nn.Parameter)
    x, *_ = data()
    layer(x).sum().backward()
    assert layer.lowrank_a.grad is not None and layer.lowrank_b.grad.abs().sum() > 0


# ------------------------------------------------------------------------- scoped recipes


def effective(r: Recipe) -> dict[str, QuantSpec]:
    """Each operand's spec with a backward None (reuse) spelled out as its forward operand's."""
    ops = {f: getattr(r, f) for f in OPERANDS}
    ops["w_dgrad"] = ops["w_dgrad"] or ops["w"]
    ops["x_wgrad"] = ops["x_wgrad"] or ops["x"]
    return ops


@pytest.mark.parametrize("scope", list(SCOPES))
@pytest.mark.parametrize("name", [n for n, r in PRESETS.items() if r.weight_storage == "master"])
def test_scope_keeps_exactly_its_operands(name, scope):
    base, r = recipe(name), recipe(f"{name}@{scope}")
    assert r.name == f"{name}@{scope}"
    for f, spec in effective(r).items():
        assert spec == (effective(base)[f] if f in SCOPES[scope] else QuantSpec.none()), f
    assert (r.attention, r.optimizer_states, r.keep_last_blocks) == (
        base.attention, base.optimizer_states, base.keep_last_blocks)
    assert r.lowrank == (base.lowrank if "w" in SCOPES[scope] else None)


def layer_and_grads(name: str, x, w, b, dy, seed: int = 0):
    layer = QuantLinear.from_linear(torch.nn.Linear(64, 48), recipe(name))
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    xg = x.clone().requires_grad_(True)
    torch.manual_seed(seed)  # the stochastic rounding draws
    y = layer(xg)
    y.backward(dy)
    return layer, y.detach(), xg.grad, layer.weight.grad


def test_scoped_layers_are_their_presets_halves():
    # With stochastic rounding on (no rne_only): each half is bit for bit the preset's own.
    x, w, b, dy = data()
    full, y, dx, dw = layer_and_grads("nvfp4-nvidia", x, w, b, dy)
    _, fy, fdx, fdw = layer_and_grads("nvfp4-nvidia@forward", x, w, b, dy)
    _, by, bdx, bdw = layer_and_grads("nvfp4-nvidia@backward", x, w, b, dy)
    _, wy, wdx, wdw = layer_and_grads("nvfp4-nvidia@weights", x, w, b, dy)
    exact_y, exact_dx, exact_dw = F.linear(x, w, b), dy @ w, dy.t() @ x
    assert torch.equal(fy, y) and torch.equal(fdx, exact_dx) and torch.equal(fdw, exact_dw)
    assert torch.equal(by, exact_y) and torch.equal(bdx, dx) and torch.equal(bdw, dw)
    qw = full.quantized_weight()
    assert torch.equal(wy, F.linear(x, qw, b)) and torch.equal(wdx, dy @ qw)
    assert torch.equal(wdw, exact_dw)
    assert not torch.equal(y, exact_y) and not torch.equal(dx, exact_dx)


def test_bad_scoped_names_say_what_exists():
    with pytest.raises(ValueError, match="recipe scope 'sideways' is unknown.*forward"):
        recipe("nvfp4@sideways")
    with pytest.raises(ValueError, match="recipe scope '' is unknown"):
        recipe("nvfp4@")
    with pytest.raises(ValueError, match="unknown recipe 'nvfp5'.*@SCOPE"):
        recipe("nvfp5@forward")


def refreshed_layer(seed=0):
    torch.manual_seed(seed)
    return QuantLinear.from_linear(torch.nn.Linear(64, 48), recipe("lowrank").with_(
        lowrank=fp4stack.LowRank(rank=4, refresh_every=3)))


def test_lowrank_forwards_are_saved_and_restored_through_the_state_dict():
    layer, x = refreshed_layer().train(), data()[0]
    for _ in range(4):
        layer(x)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    assert state["lowrank_forwards"].dtype == torch.int64 and int(state["lowrank_forwards"]) == 4
    restored = refreshed_layer(seed=1).train()
    restored.load_state_dict(state)
    assert int(restored.lowrank_forwards) == 4
    with torch.no_grad():  # the weight moves, so the next refresh (forward 6) changes the branch
        layer.weight.mul_(2.0)
        restored.weight.mul_(2.0)
    for n in (5, 6, 7):
        before = restored.lowrank_a.clone()
        layer(x)
        restored(x)
        assert torch.equal(restored.lowrank_a, layer.lowrank_a)
        assert torch.equal(restored.lowrank_a, before) == (n != 6)
    # A load rewinds a layer that has counted on: its next forward continues from the state.
    layer.load_state_dict(state)
    layer(x)
    assert int(layer.lowrank_forwards) == 5


def test_the_counter_is_host_state_that_the_state_dict_carries():
    # On the CPU whatever the layer's device, so that deciding a refresh (also inside a
    # compiled graph) never waits for the GPU; not a buffer, so DDP does not broadcast it.
    layer = refreshed_layer().train()
    assert "lowrank_forwards" not in dict(layer.named_buffers())
    layer.to(torch.bfloat16)
    if torch.cuda.is_available():
        layer.cuda()
    count = layer.lowrank_forwards
    assert count.device.type == "cpu" and count.dtype == torch.int64
    layer(data()[0].to(layer.weight))
    assert int(layer.state_dict()["lowrank_forwards"]) == 1 and layer.lowrank_forwards is count


def test_a_state_dict_without_the_counter_loads_and_counts_from_zero():
    layer, x = refreshed_layer().train(), data()[0]
    layer(x)
    old = {k: v for k, v in layer.state_dict().items() if k != "lowrank_forwards"}
    fresh = refreshed_layer(seed=1)
    fresh.load_state_dict(old)  # strict: the missing counter is not an error
    assert int(fresh.lowrank_forwards) == 0 and torch.equal(fresh.lowrank_a, layer.lowrank_a)
    layer.load_state_dict({"bias": layer.bias.detach()}, strict=False)  # a partial load
    assert int(layer.lowrank_forwards) == 1
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*\"weight\""):
        fresh.load_state_dict({k: v for k, v in old.items() if k != "weight"})


@pytest.mark.parametrize("lowrank", [None, fp4stack.LowRank(rank=4, trainable=True),
                                     fp4stack.LowRank(rank=4, refresh_every=0)])
def test_only_a_refreshed_branch_has_a_counter(lowrank):
    layer = QuantLinear.from_linear(torch.nn.Linear(64, 48), recipe("lowrank").with_(
        lowrank=lowrank))
    assert "lowrank_forwards" not in layer.state_dict()


def test_eval_forwards_are_not_counted():
    layer, x = refreshed_layer().eval(), data()[0]
    layer(x)
    assert int(layer.lowrank_forwards) == 0
