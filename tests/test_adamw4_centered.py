"""AdamW4's "sqrt-center-hadamard" second-moment transform: sqrt(v), minus its tensor mean, a
16-point random Hadamard transform, NVFP4; decoded by the exact inverse. Checked against a
float64 reference written here, measured against plain "sqrt", and trained against fp32 AdamW."""

import io

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fp4stack
from fp4stack.formats.hadamard import RHT_SIGNS
from fp4stack.optim import AdamW4, StateFormat
from fp4stack.optim.state_transforms import decode_state, encode_state, get_transform

NAME = "sqrt-center-hadamard"
CENTERED = get_transform(NAME)
pytestmark = pytest.mark.usefixtures("one_thread")


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rht_matrix64() -> torch.Tensor:
    """diag(signs) H16 / 4 in float64, H16 by Kronecker products of [[1, 1], [1, -1]]."""
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(4):
        h = torch.kron(h, h2)
    return torch.tensor(RHT_SIGNS, dtype=torch.float64)[:, None] * h / 4


def encode64(v: torch.Tensor) -> tuple[torch.Tensor, float]:
    root = v.double().sqrt()
    mean = root.mean()
    blocks = (root - mean).reshape(*v.shape[:-1], -1, 16)
    return (blocks @ rht_matrix64()).reshape(v.shape), mean.item()


def decode64(stored: torch.Tensor, mean: float) -> torch.Tensor:
    blocks = stored.double().reshape(*stored.shape[:-1], -1, 16)
    root = (blocks @ rht_matrix64().T).reshape(stored.shape) + mean
    return root.clamp(min=0) ** 2


def heavy_tailed_v(rows=256, cols=1024, steps=30, beta2=0.95, seed=0) -> torch.Tensor:
    """Adam's v after `steps` EMA updates with Student-t (3 dof) gradients: heavy tails, so a
    few entries are far above the bulk, as in real gradients."""
    gen = torch.Generator().manual_seed(seed)
    v = torch.zeros(rows, cols)
    for _ in range(steps):
        z = torch.randn(rows, cols, generator=gen)
        chi2 = sum(torch.randn(rows, cols, generator=gen) ** 2 for _ in range(3))
        g = z / (chi2 / 3).sqrt()
        v = beta2 * v + (1 - beta2) * g * g
    return v


def roundtrip(v, name, rounding="rne", seed=0):
    t = get_transform(name)
    stored, factors = encode_state(v, t)
    return decode_state(fp4stack.quantize(stored, rounding=rounding, seed=seed), t, factors)


def rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


# ---- encode and decode against float64 ------------------------------------------------------


@pytest.mark.parametrize("shape", [(8, 64), (3, 5, 32)])
def test_encode_matches_float64(shape):
    v = randn(*shape).exp() ** 2  # roots spread over ~2 decades
    stored, (mean,) = encode_state(v, CENTERED)
    ref, ref_mean = encode64(v)
    assert stored.dtype == torch.float32 and stored.shape == v.shape
    assert mean.dtype == torch.float32 and mean.dim() == 0
    assert abs(mean.item() - ref_mean) <= 1e-7 * abs(ref_mean)
    # fp32 butterflies: an error of a few ulps of the block's magnitude.
    assert (stored.double() - ref).abs().max() < 1e-6 * v.sqrt().max()


@pytest.mark.parametrize("rounding", ["rne", "stochastic"])
def test_decode_matches_float64(rounding):
    v = heavy_tailed_v(32, 128)
    stored, factors = encode_state(v, CENTERED)
    q = fp4stack.quantize(stored, rounding=rounding, seed=3)
    back = decode_state(q, CENTERED, factors)
    ref = decode64(fp4stack.dequantize(q), factors[0].item())
    assert (back >= 0).all()
    assert torch.allclose(back.double(), ref, rtol=1e-5, atol=1e-6 * ref.max().item())


@given(exponents=st.lists(st.floats(-20, 3), min_size=32, max_size=32),
       rounding=st.sampled_from(["rne", "stochastic"]))
def test_decoded_v_is_finite_and_non_negative(exponents, rounding):
    # Quantization noise can push a small root below 0 after the inverse transform: the clamp
    # keeps v >= 0 (and finite) wherever that happens.
    v = 10.0 ** torch.tensor(exponents, dtype=torch.float32).reshape(2, 16)
    back = roundtrip(v, NAME, rounding)
    assert torch.isfinite(back).all() and (back >= 0).all()


def test_decode_is_the_exact_inverse_without_rounding():
    # A constant root: every centered value is 0, so the stored tensor is all zeros (no rounding
    # at all) and decoding returns v exactly; v = 0 likewise.
    for value in (4.0, 0.0):
        v = torch.full((4, 32), value)
        stored, (mean,) = encode_state(v, CENTERED)
        assert torch.equal(stored, torch.zeros_like(v)) and mean.item() == value**0.5
        assert torch.equal(roundtrip(v, NAME), v)
    # Stored values on the E2M1 grid survive quantization exactly: decode(encode) is then
    # v up to the fp32 arithmetic of the transform pair.
    v = heavy_tailed_v(4, 32)
    stored, factors = encode_state(v, CENTERED)
    grid = fp4stack.fake_quantize(stored)
    back = decode_state(fp4stack.quantize(grid), CENTERED, factors)
    assert torch.allclose(back.double(), decode64(grid, factors[0].item()), rtol=1e-5,
                          atol=1e-7 * v.max().item())


def test_side_factor_and_layout_in_the_optimizer_state():
    p = torch.nn.Parameter(randn(64, 256))
    opt = AdamW4([p], state_format=StateFormat(transform=NAME))
    p.grad = randn(64, 256, seed=1)
    opt.step()
    s = opt.state[p]
    assert s["exp_avg_sq_mean"].dtype == torch.float32 and s["exp_avg_sq_mean"].dim() == 0
    assert "exp_avg_sq_row" not in s
    n = p.numel()
    # NVFP4 m and v (1.125 bytes per parameter), four fp32 amaxes, the step, the mean.
    assert opt.state_bytes() == n * 1.125 + 16 + 4 + 4


def test_fused_step_refuses_it_with_a_reason():
    with pytest.raises(ValueError, match="transform='rank1'"):
        AdamW4([torch.nn.Parameter(randn(64, 64))], fused=True,
               state_format=StateFormat(transform=NAME))


def test_bad_transform_name_lists_the_choices():
    with pytest.raises(ValueError, match=NAME):
        StateFormat(transform="sqrt-centre-hadamard")


# ---- the error, measured --------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("rounding", ["rne", "stochastic"])
def test_relative_error_is_well_below_plain_sqrt(seed, rounding):
    """Relative Frobenius error of sqrt(v), the quantity Adam divides by, after an NVFP4 round
    trip of heavy-tailed second moments. The paper reports about 60% lower error than plain
    sqrt; measured here (seeds 0-1): 0.038-0.040 against 0.095-0.100 with RNE, 0.054-0.057
    against 0.136-0.140 with stochastic rounding, 59-60% lower. Asserted: at least 40% lower.
    The error of v itself is not reliably lower (RNE, seed 0: 0.088 against 0.044): v's norm
    is set by its few largest entries, which plain sqrt keeps to NVFP4's relative precision.
    """
    v = heavy_tailed_v(seed=seed)
    errors = {name: rel(roundtrip(v, name, rounding, seed).sqrt(), v.sqrt())
              for name in ("sqrt", NAME)}
    v_errors = {name: rel(roundtrip(v, name, rounding, seed), v) for name in ("sqrt", NAME)}
    print(f"seed {seed} {rounding}: rel. error of sqrt(v) {errors}, of v {v_errors}, "
          f"reduction {1 - errors[NAME] / errors['sqrt']:.0%}")
    assert errors[NAME] < 0.6 * errors["sqrt"]


# ---- AdamW4 with it -------------------------------------------------------------------------


def test_mlp_regression_tracks_fp32_adamw():
    def train(make):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(512, 32, generator=g)
        y = torch.sin(x @ torch.randn(32, 8, generator=g) / 4)
        model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(),
                                    torch.nn.Linear(256, 8))
        opt = make(model.parameters())
        losses = []
        for _ in range(150):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    # Measured final loss: 0.0143 against fp32 AdamW's 0.0131 (from 0.55).
    fp32 = train(lambda p: torch.optim.AdamW(p, lr=3e-3, foreach=False))
    ours = train(lambda p: AdamW4(p, lr=3e-3, min_numel=0,
                                  state_format=StateFormat(transform=NAME)))
    print(f"final loss: fp32 AdamW {fp32[-1]:.5f}, {NAME} {ours[-1]:.5f} (start {fp32[0]:.4f})")
    assert ours[-1] < 1.5 * fp32[-1]
    # Step by step too, not only at the end (a diverging then recovering run fails here).
    assert all(o < 1.5 * f + 1e-3 for o, f in zip(ours[10:], fp32[10:], strict=True))


def test_state_dict_round_trip_continues_bit_identically():
    shapes = [(64, 128), (32, 64)]
    fmt = StateFormat(transform=NAME)
    params = [torch.nn.Parameter(randn(*s, seed=i)) for i, s in enumerate(shapes)]
    grads = [[randn(*s, seed=100 * t + i) for i, s in enumerate(shapes)] for t in range(6)]

    def run(opt, ps, stream):
        for gs in stream:
            for p, g in zip(ps, gs, strict=True):
                p.grad = g
            opt.step()

    opt = AdamW4(params, min_numel=0, state_format=fmt)
    run(opt, params, grads[:3])
    buf = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in params], "opt": opt.state_dict()}, buf)
    run(opt, params, grads[3:])
    buf.seek(0)
    saved = torch.load(buf)
    restored = [torch.nn.Parameter(t) for t in saved["params"]]
    opt2 = AdamW4(restored, min_numel=0)  # the format comes back from the state_dict
    opt2.load_state_dict(saved["opt"])
    assert opt2.state_format == fmt
    run(opt2, restored, grads[3:])
    for p, q in zip(params, restored, strict=True):
        assert torch.equal(p, q)
