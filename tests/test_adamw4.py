"""AdamW4: NVFP4 optimizer states, their transforms, and agreement with torch's AdamW."""

import io
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fp4stack
import fp4stack.optim.adamw4 as adamw4_module
from fp4stack.formats.tensor import NVFP4Tensor
from fp4stack.optim import AdamW4, StateFormat
from fp4stack.optim.adamw4_state import read_v
from fp4stack.optim.state_format import DEFAULT_FORMAT
from fp4stack.optim.state_transforms import TRANSFORMS, decode_state, encode_state, get_transform

NAMES = list(TRANSFORMS)
# Stored grows with v, zeros lifted to a floor (rsqrt shrinks; a centered transform stores
# signed Hadamard coefficients: tests/test_adamw4_centered.py).
INCREASING = [n for n in NAMES if n != "rsqrt" and not TRANSFORMS[n].centered]

pytestmark = pytest.mark.usefixtures("one_thread")
DEFAULT_HEADROOM = DEFAULT_FORMAT.headroom


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def params_like(*tensors):
    return [torch.nn.Parameter(t.clone()) for t in tensors]


def run(opt, params, grads):
    """Apply each list of gradients in turn (None leaves a parameter without a gradient)."""
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = None if g is None else g.clone()
        opt.step()


def grad_stream(shapes, steps, seed=0):
    return [[randn(*s, seed=seed + 1000 * i + j) for j, s in enumerate(shapes)]
            for i in range(steps)]


def nvfp4_state(opt, p, name):
    s = opt.state[p]
    return NVFP4Tensor(data=s[f"{name}_data"], scales=s[f"{name}_scales"],
                       amax=s[f"{name}_amax"], shape=p.shape, spec=fp4stack.QuantSpec())


def roundtrip(v, name, rounding="rne", seed=0):
    """v through encode, NVFP4 quantization and decode, as the optimizer stores it."""
    t = get_transform(name)
    stored, factors = encode_state(v, t)
    q = fp4stack.quantize(stored, rounding=rounding, seed=seed)
    return decode_state(q, t, factors)


# ---- the states are NVFP4 -------------------------------------------------------------------


@pytest.mark.parametrize("first_moment", ["direct", "normalized"])
def test_states_are_packed_nvfp4_fields(first_moment):
    p = torch.nn.Parameter(randn(64, 256))
    opt = AdamW4([p], state_format=StateFormat(transform="sqrt", rounding="rne",
                                               first_moment=first_moment, scaling="current"))
    g = randn(64, 256, seed=1)
    p.grad = g
    opt.step()
    s = opt.state[p]
    n = p.numel()
    for name in ("exp_avg", "exp_avg_sq"):
        assert s[f"{name}_data"].dtype == torch.uint8 and s[f"{name}_data"].numel() == n // 2
        assert s[f"{name}_scales"].dtype == torch.float8_e4m3fn
        assert s[f"{name}_scales"].numel() == n // 16
        assert s[f"{name}_amax"].dtype == torch.float32 and s[f"{name}_amax"].dim() == 0
    assert "exp_avg" not in s and "exp_avg_sq" not in s

    # The fields are exactly fp4stack.quantize of fp32 AdamW's moments: sqrt(v) for v, and m or
    # m / sqrt(v as read back) for m.
    ref = torch.nn.Parameter(randn(64, 256))
    torch_opt = torch.optim.AdamW([ref], foreach=False)
    ref.grad = g
    torch_opt.step()
    m, v = torch_opt.state[ref]["exp_avg"], torch_opt.state[ref]["exp_avg_sq"]
    v_read = decode_state(nvfp4_state(opt, p, "exp_avg_sq"), get_transform("sqrt"))
    assert torch.equal(v_read, roundtrip(v, "sqrt"))
    m_stored = m / v_read.sqrt() if first_moment == "normalized" else m
    for name, x in (("exp_avg", m_stored), ("exp_avg_sq", v.sqrt())):
        q = fp4stack.quantize(x)
        assert torch.equal(s[f"{name}_data"], q.data)
        assert torch.equal(s[f"{name}_scales"].view(torch.uint8), q.scales.view(torch.uint8))
        assert torch.equal(s[f"{name}_amax"], q.amax)
    # Dequantizing the fields gives the m the next step starts from.
    assert torch.equal(fp4stack.dequantize(nvfp4_state(opt, p, "exp_avg")),
                       fp4stack.fake_quantize(m_stored))


@pytest.mark.parametrize("transform", ["sqrt", "rank1"])
def test_state_bytes_are_1_125_per_param_for_large_matrices(transform):
    p = torch.nn.Parameter(randn(256, 256))
    opt = AdamW4([p], state_format=StateFormat(transform=transform))
    p.grad = randn(256, 256, seed=1)
    opt.step()
    n = p.numel()
    # m and v: n/2 code bytes and n/16 scale bytes each, two fp32 amaxes each (the current and
    # the next), the fp32 step counter; rank1 adds an fp32 root per row and per column.
    extra = 4 * (256 + 256) if transform == "rank1" else 0
    assert opt.state_bytes() == n * 1.125 + 16 + 4 + extra
    assert opt.state_bytes() / n < 1.16


def test_small_odd_and_1d_tensors_keep_fp32_states():
    shapes = {"bias": (256,), "small": (32, 64), "odd": (128, 40), "big": (64, 128)}
    params = {k: torch.nn.Parameter(randn(*s)) for k, s in shapes.items()}
    opt = AdamW4(params.values(), min_numel=4096)
    run(opt, list(params.values()), grad_stream(shapes.values(), 1))
    for name, p in params.items():
        s = opt.state[p]
        if name == "big":
            assert "exp_avg_data" in s and "exp_avg" not in s
        else:
            assert s["exp_avg"].dtype == torch.float32 and s["exp_avg"].shape == p.shape
            assert s["exp_avg_sq"].dtype == torch.float32 and "exp_avg_data" not in s
    fp32 = sum(8 * p.numel() + 4 for k, p in params.items() if k != "big")
    rank1 = 4 * (64 + 128)  # the default transform's fp32 row and column roots
    assert opt.state_bytes() == fp32 + 64 * 128 * 1.125 + 16 + 4 + rank1


# ---- transforms -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_transform_inverts_encode(name):
    t = get_transform(name)
    v = 10.0 ** torch.linspace(-12, 3, 4096)
    back = t.decode(t.encode(v))
    # log and rsqrt lose digits to cancellation (an offset is added then removed).
    rtol = {"log": 1e-4, "rsqrt": 1e-4}.get(name, 1e-6)
    assert torch.allclose(back, v, rtol=rtol, atol=0)
    assert t.decode(t.encode(torch.zeros(16))).abs().max() <= (1e-15 if name == "rsqrt" else 0)


@pytest.mark.parametrize("name", ["v", "sqrt", "pow4"])
def test_transform_is_exact_on_powers_of_16(name):
    t = get_transform(name)
    v = 16.0 ** torch.arange(-20, 20, dtype=torch.float32)
    assert torch.equal(t.decode(t.encode(v)), v)


@pytest.mark.parametrize("name", INCREASING)
@given(exponents=st.lists(st.floats(-30, 3), min_size=16, max_size=16),
       rounding=st.sampled_from(["rne", "stochastic"]))
def test_quantized_v_is_never_zero_inf_or_nan(name, exponents, rounding):
    v = 10.0 ** torch.tensor(exponents, dtype=torch.float32)
    back = roundtrip(v.reshape(1, 16), name, rounding)
    assert torch.isfinite(back).all() and (back > 0).all()


@pytest.mark.parametrize("name", ["sqrt", "pow4", "rank1"])
def test_floor_only_raises_v(name):
    # A zero code decodes to its block's smallest value: v comes back larger, never smaller than
    # by the rounding error, so m / sqrt(v) cannot explode.
    v = (10.0 ** torch.linspace(-12, 0, 1024)).reshape(64, 16)
    back = roundtrip(v, name)
    assert (back >= 0.2 * v).all()
    assert torch.allclose(back[:, -4:], v[:, -4:], rtol=0.6)


def test_rank1_removes_a_separable_scale():
    # v = a b^T spanning 8 decades along each block: sqrt alone floors most of each block, rank1
    # normalises the scale away and keeps every entry within NVFP4's relative error.
    a = 10.0 ** torch.linspace(-4, 0, 32)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    b = 10.0 ** torch.linspace(-4, 0, 64)[perm]
    v = a[:, None] * b[None, :]
    assert torch.allclose(roundtrip(v, "rank1"), v, rtol=0.01)
    assert not torch.allclose(roundtrip(v, "sqrt"), v, rtol=1.0)


# ---- agreement with torch.optim.AdamW -------------------------------------------------------


SHAPES = [(32, 64), (128,), (48, 32)]


@pytest.mark.parametrize("hp", [
    dict(lr=1e-3),
    dict(lr=3e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    dict(lr=1e-2, weight_decay=0.0),
])
def test_fp32_states_equal_torch_adamw_bit_for_bit(hp):
    init = [randn(*s, seed=i) for i, s in enumerate(SHAPES)]
    grads = grad_stream(SHAPES, 8)
    grads[3][1] = None  # a parameter without a gradient is skipped
    ours, theirs = params_like(*init), params_like(*init)
    run(AdamW4(ours, state_format=StateFormat(transform="none"), **hp), ours, grads)
    run(torch.optim.AdamW(theirs, foreach=False, **hp), theirs, grads)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fp32_states_on_cuda_equal_torch_foreach_adamw_bit_for_bit():
    # On CUDA the fp32 states take torch's multi-tensor ops, as torch's foreach AdamW does.
    init = [randn(*s, seed=i).cuda() for i, s in enumerate(SHAPES)]
    grads = [[g.cuda() if g is not None else None for g in gs] for gs in grad_stream(SHAPES, 6)]
    grads[2][0] = None
    ours, theirs = params_like(*init), params_like(*init)
    hp = dict(lr=3e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    run(AdamW4(ours, state_format=StateFormat(transform="none"), **hp), ours, grads)
    run(torch.optim.AdamW(theirs, foreach=True, **hp), theirs, grads)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def test_fp32_states_take_one_batched_step(monkeypatch):
    # All fp32-state tensors of a group go through one foreach update, none through the
    # per-parameter step (which a model's many norms would make launch-bound).
    calls = []
    real = adamw4_module.adamw_update_foreach
    monkeypatch.setattr(adamw4_module, "adamw_update_foreach",
                        lambda params, *a: calls.append(len(params)) or real(params, *a))
    monkeypatch.setattr(adamw4_module, "adamw_update", None)  # would fail if called
    params = params_like(*(randn(*s, seed=i) for i, s in enumerate(SHAPES)))
    opt = AdamW4(params)
    for g, p in zip(grad_stream(SHAPES, 1)[0], params, strict=True):
        p.grad = g
    opt.step()
    assert calls == [len(SHAPES)]


def test_fallback_tensors_follow_torch_adamw_bit_for_bit():
    # With the default transform, tensors under the size rule still compute exactly as torch.
    init = [randn(*s, seed=i) for i, s in enumerate(SHAPES)]
    grads = grad_stream(SHAPES, 5)
    ours, theirs = params_like(*init), params_like(*init)
    run(AdamW4(ours), ours, grads)
    run(torch.optim.AdamW(theirs, foreach=False), theirs, grads)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rounding", ["rne", "stochastic"])
@pytest.mark.parametrize("transform", NAMES)
@pytest.mark.parametrize("first_moment", ["normalized", "direct"])
def test_first_step_is_torch_adamw_first_step(transform, rounding, first_moment):
    # Fresh states must decode to m = v = 0 whatever the transform (rsqrt stores v = 0 as 1/c).
    init, g = randn(64, 64), randn(64, 64, seed=1, scale=1e-3)
    ours, theirs = params_like(init, init)
    fmt = StateFormat(transform=transform, rounding=rounding, first_moment=first_moment)
    run(AdamW4([ours], state_format=fmt), [ours], [[g]])
    run(torch.optim.AdamW([theirs], foreach=False), [theirs], [[g]])
    # Within 2 ulps: the quantized path rounds sqrt exactly and orders ops its own way (see
    # quantized_update); decoding a fresh state wrongly would be far off.
    assert torch.allclose(ours, theirs, rtol=2**-22, atol=1e-7)


def test_params_without_grad_get_no_state():
    a, b = params_like(randn(64, 64), randn(64, 64))
    opt = AdamW4([a, b])
    run(opt, [a, b], [[randn(64, 64), None]])
    assert b not in opt.state and torch.equal(b, randn(64, 64))


@pytest.mark.parametrize("transform", ["sqrt", "none"])
def test_weight_decay_is_decoupled(transform):
    # A zero gradient leaves m = v = 0 and a zero Adam step: only p *= 1 - lr * wd remains.
    init = randn(64, 64)
    ours, theirs = params_like(init, init)
    grads = [[torch.zeros(64, 64)]] * 3
    run(AdamW4([ours], lr=0.1, weight_decay=0.5, state_format=StateFormat(transform=transform)),
        [ours], grads)
    run(torch.optim.AdamW([theirs], lr=0.1, weight_decay=0.5, foreach=False), [theirs], grads)
    assert torch.equal(ours, theirs)
    assert torch.allclose(ours, init * 0.95**3)


# ---- delayed scaling -------------------------------------------------------------------------


def twin_scalings(steps, grads_at, shape=(64, 256), headroom=DEFAULT_HEADROOM, **options):
    """A delayed-scaling and a current-scaling AdamW4 fed the same gradients; yields
    (step, delayed state, current state, delayed param) after each step."""
    params = params_like(randn(*shape), randn(*shape))
    delayed = AdamW4([params[0]], min_numel=0, state_format=StateFormat(headroom=headroom),
                     **options)
    current = AdamW4([params[1]], min_numel=0,
                     state_format=StateFormat(scaling="current", headroom=headroom), **options)
    for step in range(1, steps + 1):
        for p, opt in zip(params, (delayed, current), strict=True):
            p.grad = grads_at(step)
            opt.step()
        yield step, delayed.state[params[0]], current.state[params[1]], params[0]


@pytest.mark.parametrize("headroom", [2.0, 4.0])
def test_delayed_scaling_encodes_with_headroom_times_the_previous_amax(headroom):
    previous = None
    runs = twin_scalings(4, lambda step: randn(64, 256, seed=step), headroom=headroom)
    for step, delayed, current, _ in runs:
        if step == 1:
            # The first step calibrates on its own v: the same stored v as current scaling
            # (same v, same rank-1 factors), encoded with headroom x its amax.
            assert torch.equal(delayed["exp_avg_sq_amax"], headroom * current["exp_avg_sq_amax"])
        else:
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(delayed[f"{name}_amax"], previous[f"{name}_next_amax"])
        for name in ("exp_avg", "exp_avg_sq"):
            # The next amax is headroom x the largest stored value (up to its rounding): the
            # stored codes dequantize to at most that over headroom, one grid step up.
            stored = fp4stack.dequantize(NVFP4Tensor(
                data=delayed[f"{name}_data"], scales=delayed[f"{name}_scales"],
                amax=delayed[f"{name}_amax"], shape=torch.Size((64, 256)),
                spec=fp4stack.QuantSpec()))
            top = float(stored.abs().max()) * headroom
            assert 0 < float(delayed[f"{name}_next_amax"]) <= 1.5 * top
            assert float(delayed[f"{name}_next_amax"]) >= top / 1.5
        previous = {k: v.clone() for k, v in delayed.items()}


def test_a_gradient_spike_saturates_then_the_scale_catches_up():
    # Steady gradients, then 1000x larger ones at scattered elements (a spike the rank-1
    # estimate cannot absorb, as it would a spiking row or a lone element): the stored v
    # exceeds headroom x its previous amax and saturates for that step. Everything stays
    # finite, v is still read back positive, the step is no larger than Adam's bound, and the
    # next step encodes with the spike's amax.
    scattered = torch.rand(64, 256, generator=torch.Generator().manual_seed(5)) < 0.05

    def grads(step):
        g = randn(64, 256, seed=step)
        if step == 6:
            g[scattered] *= 1000
        return g

    before = None
    for step, delayed, _, p in twin_scalings(7, grads, lr=1e-2):
        if step == 5:
            before = p.detach().clone()
            next_v = delayed["exp_avg_sq_next_amax"].clone()
        if step == 6:
            assert torch.equal(delayed["exp_avg_sq_amax"], next_v)  # encoded with the old one
            assert float(delayed["exp_avg_sq_next_amax"]) > 4 * float(next_v)  # saw the spike
            moved = (p.detach() - before).abs()
            # |m / sqrt(v)| <= (1 - b1) / sqrt(1 - b2) / sqrt(1 - b1^2 / b2) ~ 7.3 (no bias
            # correction); with it (step 6), a few times more: bounded, not m / eps.
            assert torch.isfinite(moved).all() and float(moved.max()) < 1e-2 * 20
        if step == 7:
            v, root = read_v(delayed, get_transform("rank1"), p.shape)
            assert torch.isfinite(v).all() and (v > 0).all()
            assert torch.isfinite(p).all()


def test_a_state_saved_before_delayed_scaling_loads_and_steps():
    # The layout before delayed scaling: no next amaxes, rank-1 factors kept as means (not
    # their roots). Loading converts it; the next step runs and is close to the current one.
    shapes = [(64, 128)]
    params = params_like(randn(64, 128))
    opt = AdamW4(params, min_numel=0)
    run(opt, params, grad_stream(shapes, 3))
    saved = opt.state_dict()
    old = {k: v.clone() for k, v in saved["state"][0].items()
           if not k.endswith("_next_amax")}
    old["exp_avg_sq_row"] = old["exp_avg_sq_row"] ** 2
    old["exp_avg_sq_col"] = old["exp_avg_sq_col"] ** 2
    groups = [{k: v for k, v in g.items() if k not in ("scaling", "headroom")}
              for g in saved["param_groups"]]
    restored = params_like(params[0].detach())
    opt2 = AdamW4(restored, min_numel=0)
    opt2.load_state_dict({"state": {0: old}, "param_groups": groups})
    state = opt2.state[restored[0]]
    assert opt2.state_format.scaling == "delayed"
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(state[f"{name}_next_amax"], DEFAULT_HEADROOM * state[f"{name}_amax"])
    torch.testing.assert_close(state["exp_avg_sq_row"], saved["state"][0]["exp_avg_sq_row"])
    g = randn(64, 128, seed=99)
    for p, o in ((params[0], opt), (restored[0], opt2)):
        p.grad = g.clone()
        o.step()
    torch.testing.assert_close(restored[0], params[0], rtol=0, atol=1e-5)


# ---- the optimizer API ----------------------------------------------------------------------


def test_state_dict_round_trip_continues_bit_identically():
    shapes = [(64, 128), (64,), (32, 48), (96, 40)]
    init = [randn(*s, seed=i) for i, s in enumerate(shapes)]
    grads = grad_stream(shapes, 10)
    params = params_like(*init)
    for p in params[2:]:  # NVFP4 fields and fp32 states of bf16 params must keep their dtypes
        p.data = p.data.bfloat16()
    grads = [[g if p.dtype == torch.float32 else g.bfloat16() for g, p in zip(gs, params,
              strict=True)] for gs in grads]
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}]
    opt = AdamW4(groups, min_numel=1024)
    run(opt, params, grads[:5])
    buf = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in params], "opt": opt.state_dict()}, buf)
    run(opt, params, grads[5:])

    buf.seek(0)
    saved = torch.load(buf)
    restored = [torch.nn.Parameter(t) for t in saved["params"]]
    opt2 = AdamW4([{"params": restored[:2]},
                   {"params": restored[2:], "lr": 3e-3}], min_numel=1024)
    opt2.load_state_dict(saved["opt"])
    for p, q in zip(params, restored, strict=True):
        for k, v in opt2.state[q].items():
            assert v.dtype == opt.state[p][k].dtype, k
    run(opt2, restored, grads[5:])
    for p, q in zip(params, restored, strict=True):
        assert torch.equal(p, q)
    assert opt2.state[restored[2]]["exp_avg_data"].dtype == torch.uint8
    assert opt2.state[restored[3]]["exp_avg"].dtype == torch.float32


def test_each_parameter_draws_its_own_rounding():
    # Two identical parameters with identical gradients: same seed, different index, other bits.
    a, b = params_like(randn(64, 64), randn(64, 64))
    g = randn(64, 64, seed=1)
    run(AdamW4([a, b], state_format=StateFormat(transform="sqrt")), [a, b], [[g, g], [g, g]])
    assert not torch.equal(a, b)


def test_same_seed_repeats_and_another_seed_differs():
    def train(seed):
        p = torch.nn.Parameter(randn(64, 64))
        run(AdamW4([p], seed=seed), [p], grad_stream([(64, 64)], 4))
        return p.detach()

    assert torch.equal(train(1), train(1))
    assert not torch.equal(train(1), train(2))


def test_param_groups_and_lr_scheduler():
    a, b = params_like(randn(64, 64), randn(64, 64, seed=1))
    opt = AdamW4([{"params": [a], "lr": 1e-2}, {"params": [b], "lr": 0.0}])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.0)
    run(opt, [a, b], grad_stream([(64, 64)] * 2, 1))
    assert torch.equal(b, randn(64, 64, seed=1))  # lr 0: no step, no decay
    moved = a.detach().clone()
    assert not torch.equal(moved, randn(64, 64))
    sched.step()  # lr -> 0 for the next step
    run(opt, [a, b], grad_stream([(64, 64)] * 2, 1, seed=7))
    assert torch.equal(a, moved) and opt.param_groups[0]["lr"] == 0.0


def test_works_with_gradient_clipping():
    p = torch.nn.Parameter(randn(64, 64))
    opt = AdamW4([p])
    p.grad = randn(64, 64, scale=1e3)
    torch.nn.utils.clip_grad_norm_([p], 1.0)
    opt.step()
    assert torch.isfinite(p).all()


def test_bf16_params_update_through_fp32():
    p = torch.nn.Parameter(randn(64, 64).bfloat16())
    opt = AdamW4([p], lr=1e-2)
    run(opt, [p], [[randn(64, 64).bfloat16()]])
    assert p.dtype == torch.bfloat16 and not torch.equal(p, randn(64, 64).bfloat16())


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=-1.0), "learning rate"),
    (dict(eps=-1e-8), "eps"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(betas=(0.9, 1.0)), "betas"),
    (dict(state_format="rank1"), "state_format"),
    (dict(min_numel=-1), "min_numel"),
    (dict(seed=-3), "seed"),
    (dict(amsgrad=True), "amsgrad"),
    (dict(maximize=True), "maximize"),
    (dict(foreach=True), "foreach"),
    (dict(fused="yes"), "fused"),  # fused=True is tested in test_adamw4_fused.py
])
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdamW4([torch.nn.Parameter(torch.zeros(4))], **kwargs)


def test_bad_group_option_raises():
    opt = AdamW4([torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match="'transform' is not a param-group option"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4))], "transform": "x"})
    assert len(opt.param_groups) == 1


# ---- the state format ------------------------------------------------------------------------


@pytest.mark.parametrize("fields, match", [
    (dict(transform="cube"), "unknown transform 'cube'"),
    (dict(rounding="floor"), "rounding must be one of"),
    (dict(first_moment="sign"), "first_moment must be one of"),
    (dict(scaling="static"), "scaling must be one of"),
    (dict(headroom=0.5), "headroom must be a finite number >= 1"),
    (dict(headroom=float("inf")), "headroom must be a finite number >= 1"),
    (dict(headroom=True), "headroom must be a finite number >= 1"),
    (dict(headroom="4"), "headroom must be a finite number >= 1"),
])
def test_state_format_validates_each_field(fields, match):
    with pytest.raises(ValueError, match=f"StateFormat: {match}"):
        StateFormat(**fields)


def test_state_format_is_frozen():
    fmt = StateFormat(headroom=2)
    assert fmt.headroom == 2.0 and isinstance(fmt.headroom, float)
    with pytest.raises(AttributeError):
        fmt.transform = "sqrt"


def test_default_equals_an_explicit_default_state_format_bit_for_bit():
    shapes = [(64, 128), (128,), (32, 48), (3, 16, 64)]
    init = [randn(*s, seed=i) for i, s in enumerate(shapes)]
    grads = grad_stream(shapes, 4)
    explicit = StateFormat(transform="rank1", rounding="stochastic", first_moment="normalized",
                           scaling="delayed", headroom=4.0)
    runs = []
    for fmt in (None, explicit):
        params = params_like(*init)
        opt = AdamW4(params, min_numel=1024, seed=5, **({} if fmt is None else
                                                        {"state_format": fmt}))
        run(opt, params, grads)
        runs.append((params, opt))
    (pa, oa), (pb, ob) = runs
    assert oa.state_format == ob.state_format == DEFAULT_FORMAT
    for a, b in zip(pa, pb, strict=True):
        assert torch.equal(a, b)
        assert oa.state[a].keys() == ob.state[b].keys()
        for key, value in oa.state[a].items():
            other = ob.state[b][key]
            assert value.dtype == other.dtype, key
            if value.dtype == torch.float8_e4m3fn:  # compared as bits
                value, other = value.view(torch.uint8), other.view(torch.uint8)
            assert torch.equal(value, other), key
    assert "exp_avg_sq_row" in oa.state[pa[0]]


def test_a_variant_is_reachable_through_state_format_only():
    # The study's variants are not constructor options of their own...
    with pytest.raises(TypeError, match="transform"):
        AdamW4([torch.nn.Parameter(torch.zeros(64, 64))], transform="sqrt")
    # ...but a StateFormat: it changes the stored states, is saved with them, and a loaded
    # state_dict brings its format along (as torch restores a group's options).
    variant = StateFormat(transform="sqrt", rounding="rne", first_moment="direct",
                          scaling="current")
    shapes = [(64, 64)]
    grads = grad_stream(shapes, 6)
    params = params_like(randn(64, 64))
    opt = AdamW4(params, state_format=variant)
    run(opt, params, grads[:3])
    assert "exp_avg_data" in opt.state[params[0]]
    assert "exp_avg_sq_row" not in opt.state[params[0]]  # no rank-1 factors with sqrt
    saved = opt.state_dict()
    assert saved["param_groups"][0]["transform"] == "sqrt"
    assert saved["param_groups"][0]["state_rounding"] == "rne"
    restored = params_like(params[0].detach())
    opt2 = AdamW4(restored)
    opt2.load_state_dict(saved)
    assert opt2.state_format == variant and "transform" not in opt2.param_groups[0]
    run(opt, params, grads[3:])
    run(opt2, restored, grads[3:])
    assert torch.equal(params[0], restored[0])
    default = params_like(randn(64, 64))
    run(AdamW4(default), default, grads)
    assert not torch.equal(default[0], params[0])


def test_a_state_dict_whose_groups_disagree_on_the_format_raises():
    params = params_like(randn(64, 64), randn(64, 64))
    opt = AdamW4([{"params": params[:1]}, {"params": params[1:]}])
    saved = opt.state_dict()
    saved["param_groups"][1]["transform"] = "sqrt"
    with pytest.raises(ValueError, match="different state formats"):
        AdamW4([{"params": params[:1]}, {"params": params[1:]}]).load_state_dict(saved)


def test_sparse_gradients_raise():
    emb = torch.nn.Embedding(64, 64, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        AdamW4(emb.parameters()).step()


def test_complex_params_raise():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.complex64))
    p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="complex"):
        AdamW4([p]).step()


# ---- training behaviour ---------------------------------------------------------------------


def quadratic_losses(make, steps=200, every=40):
    """sum a (x - c)^2 with curvatures a spanning six decades, cosine-decayed lr from 3e-2."""
    g = torch.Generator().manual_seed(0)
    a = 10.0 ** (torch.rand(32, 128, generator=g) * 6 - 3)
    c = torch.randn(32, 128, generator=g)
    x = torch.nn.Parameter(torch.zeros(32, 128))
    opt = make([x])
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    losses = []
    for i in range(steps):
        opt.zero_grad()
        (a * (x - c) ** 2).sum().backward()
        opt.step()
        sched.step()
        if (i + 1) % every == 0:
            losses.append(float((a * (x.detach() - c) ** 2).sum()))
    return torch.tensor(losses)


@pytest.fixture(scope="module")
def quadratic_fp32():
    return quadratic_losses(lambda p: torch.optim.AdamW(p, lr=3e-2, weight_decay=0, foreach=False))


def test_quadratic_follows_fp32_adamw(quadratic_fp32):
    # Measured: the loss stays within 0.84x..1.00x of fp32 AdamW's at every checkpoint.
    ours = quadratic_losses(lambda p: AdamW4(p, lr=3e-2, weight_decay=0))
    ratio = ours / quadratic_fp32
    assert ((ratio > 0.75) & (ratio < 1.3)).all(), ratio


def test_quadratic_rne_states_fall_behind(quadratic_fp32):
    # Measured: RNE state rounding ends about 3.6x above fp32 AdamW on the same problem.
    rne = quadratic_losses(lambda p: AdamW4(p, lr=3e-2, weight_decay=0,
                                                      state_format=StateFormat(rounding="rne")))
    assert rne[-1] > 2 * quadratic_fp32[-1]


def test_quadratic_against_torchao_adamw4bit(quadratic_fp32, monkeypatch):
    # torchao compiles its step; in eager mode it runs on CPU. Measured: its loss ends ~19x
    # above fp32 AdamW (one 128-block scale, no stochastic rounding), AdamW4's ~0.95x.
    optim = pytest.importorskip("torchao.optim")
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    try:
        theirs = quadratic_losses(lambda p: optim.AdamW4bit(p, lr=3e-2, weight_decay=0))
    except Exception as e:  # noqa: BLE001 - any failure of the peer means "not comparable here"
        pytest.skip(f"torchao AdamW4bit does not run here: {e}")
    ours = quadratic_losses(lambda p: AdamW4(p, lr=3e-2, weight_decay=0))
    assert ours[-1] < theirs[-1]


def test_mlp_regression_within_a_factor_of_fp32_adamw():
    def train(make):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(512, 32, generator=g)
        y = torch.sin(x @ torch.randn(32, 8, generator=g) / 4)
        model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(),
                                    torch.nn.Linear(256, 8))
        opt = make(model.parameters())
        for _ in range(150):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(model(x), y))

    # Measured: 0.0125 against fp32 AdamW's 0.0128 (from 0.06 at the start).
    fp32 = train(lambda p: torch.optim.AdamW(p, lr=3e-3, foreach=False))
    ours = train(lambda p: AdamW4(p, lr=3e-3, min_numel=0))
    assert ours < 1.5 * fp32


def stale_run(rounding, steps=300, lr=1e-3):
    """Steady state m = v = 1, then the odd columns' gradients stop. Returns the odd columns'
    mean decoded v and mean |m|, and how far their parameters moved."""
    p = torch.nn.Parameter(torch.zeros(64, 64))
    fmt = StateFormat(transform="sqrt", rounding=rounding, first_moment="direct")
    opt = AdamW4([p], lr=lr, weight_decay=0, state_format=fmt)
    p.grad = torch.ones(64, 64)
    opt.step()
    state = opt.state[p]
    state["step"].fill_(10_000)  # bias corrections ~1, as deep into training
    ones = fp4stack.quantize(torch.ones(64, 64))
    for name in ("exp_avg", "exp_avg_sq"):
        for field in ("data", "scales", "amax"):
            state[f"{name}_{field}"] = getattr(ones, field)
        state[f"{name}_next_amax"] = DEFAULT_HEADROOM * ones.amax
    start = p.detach().clone()
    grad = torch.ones(64, 64)
    grad[:, 1::2] = 0
    for _ in range(steps):
        p.grad = grad
        opt.step()
    v = decode_state(nvfp4_state(opt, p, "exp_avg_sq"), get_transform("sqrt"))
    m = fp4stack.dequantize(nvfp4_state(opt, p, "exp_avg"))
    moved = (p.detach() - start)[:, 1::2].abs().mean()
    return float(v[:, 1::2].mean()), float(m[:, 1::2].abs().mean()), float(moved)


def test_rne_states_go_stale_where_stochastic_rounding_keeps_moving():
    # fp32 AdamW: v decays to 0.999^300 = 0.741, m to 0.9^300 ~ 0, and a parameter whose
    # gradient stopped moves ~ lr * sum(0.9^t) = 10 lr in total.
    v_fp32 = 0.999**300
    v, m, moved = stale_run("rne")
    # RNE: 0.999 v and 0.9 m round back to the block max's grid point, every step.
    assert v == 1.0 and m == 1.0
    assert moved > 250 * 1e-3  # keeps drifting by lr per step on a zero gradient
    v, m, moved = stale_run("stochastic")
    assert abs(v / v_fp32 - 1) < 0.1  # measured 0.786 (SR is unbiased for sqrt(v), not v)
    assert m == 0.0 and moved < 20 * 1e-3


def row_movement(first_moment, steps=40):
    """How far each row of a matrix moves, relative to fp32 AdamW, when the rows' gradients
    differ by 8 decades (rare and frequent tokens of an embedding)."""
    scale = 10.0 ** torch.linspace(-8, 0, 64)[:, None]

    def run_with(make):
        p = torch.nn.Parameter(torch.zeros(64, 256))
        opt, g = make([p]), torch.Generator().manual_seed(0)
        for _ in range(steps):
            p.grad = scale * (1 + 0.5 * torch.randn(64, 256, generator=g))
            opt.step()
        return p.detach().mean(1)

    ref = run_with(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0, foreach=False))
    fmt = StateFormat(first_moment=first_moment)
    return run_with(lambda p: AdamW4(p, lr=1e-2, weight_decay=0, state_format=fmt)) / ref


def test_rows_with_tiny_gradients_move_like_fp32_adamw():
    # m / sqrt(v) is O(1) on every row, so NVFP4 keeps it; m itself on rows 1e-6 below the
    # tensor's max falls under the smallest E4M3 block scale and rounds to zero.
    moved = row_movement("normalized")
    assert ((moved > 0.8) & (moved < 1.25)).all(), moved
    direct = row_movement("direct")
    assert (direct[:16] < 0.3).all() and (direct[-16:] > 0.8).all(), direct
