"""The NVFP4 torch reference (fp4stack.quantize / dequantize / fake_quantize on CPU).

Covers the spec's list of edge cases, shapes and dtypes, the error level on randn, the
differential identities between options (fake_quantize, 2D tiles and transposes, columnwise,
imposed amax, padding), the straight-through gradient, and input validation.
"""

import itertools

import numpy as np
import pytest
import spec_oracle as oracle
import torch

import fp4stack
from fp4stack.formats import QuantSpec, global_encode_scale, rht
from fp4stack.formats import nvfp4 as reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLT_MAX = torch.finfo(torch.float32).max


def randn(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def assert_same_nvfp4(a, b):
    assert torch.equal(a.data, b.data)
    assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
    assert torch.equal(a.amax.view(torch.int32), b.amax.view(torch.int32))
    assert a.shape == b.shape and a.spec == b.spec


def oracle_check(x, t, **kw):
    data, scales, amax = oracle.quantize(x.float().numpy(), **kw)
    np.testing.assert_array_equal(t.data.numpy(), data)
    np.testing.assert_array_equal(t.scales.view(torch.uint8).numpy(), scales)
    assert np.float32(t.amax.item()) == amax


# ----------------------------------------------------------------------------------------------
# Edge cases from the spec.
# ----------------------------------------------------------------------------------------------
def test_global_encode_scale_formula():
    assert global_encode_scale(torch.tensor(0.0)).item() == 1.0  # amax == 0
    assert global_encode_scale(torch.tensor(2688.0)).item() == 1.0
    assert global_encode_scale(torch.tensor(1e-45)).item() == FLT_MAX  # capped at FLT_MAX
    assert global_encode_scale(torch.tensor(float("inf"))).item() == 1.0  # S_enc == 0
    a = torch.tensor(3.7)
    assert global_encode_scale(a).item() == (torch.tensor(2688.0) / a).item()
    assert global_encode_scale(a, 256.0).item() == (torch.tensor(1536.0) / a).item()


def test_tiny_amax_decodes_with_the_scale_that_encoded():
    # Below amax = 2688 / FLT_MAX (about 7.9e-36) S_enc is capped at FLT_MAX; decoding must use
    # its inverse 2^-128, not amax / 2688 (which shrank such tensors about 25x or more).
    g = torch.Generator().manual_seed(0)
    for magnitude in (1e-36, 1e-37):
        x = torch.randn(4, 64, generator=g) * magnitude
        t = fp4stack.quantize(x)
        assert global_encode_scale(t.amax).item() == FLT_MAX
        assert t.decode_scale.item() == 2.0**-128 == (1 / global_encode_scale(t.amax)).item()
        y = fp4stack.fake_quantize(x).double()
        rel = ((y - x.double()).norm() / x.double().norm()).item()
        assert rel < 0.12, rel  # the usual NVFP4 error of Gaussian data (about 0.09)
    # Just above the threshold the encode scale is not capped: D stays amax * (1/2688).
    a = torch.tensor(2688.0) / FLT_MAX
    a = torch.nextafter(a, torch.tensor(1.0))
    while not torch.isfinite(torch.tensor(2688.0) / a):
        a = torch.nextafter(a, torch.tensor(1.0))
    t = fp4stack.quantize(torch.full((1, 16), a.item()))
    assert t.decode_scale.item() == (a * torch.tensor(1 / 2688.0)).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "opts",
    [{}, {"block": (16, 16)}, {"four_over_six": True}, {"hadamard": True},
     {"rounding": "stochastic", "seed": 3}],
)
def test_all_zero(dtype, opts):
    x = torch.zeros(3, 40 if not opts.get("hadamard") else 48, dtype=dtype)
    t = fp4stack.quantize(x, **opts)
    assert t.amax.item() == 0.0
    assert (t.data == 0).all()
    assert (t.scales.view(torch.uint8) == 0).all()
    y = fp4stack.dequantize(t, dtype)
    assert y.dtype == dtype and y.shape == x.shape
    assert not torch.isnan(y).any()
    assert torch.equal(y, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_finfo_max(dtype):
    big = torch.finfo(dtype).max
    x = torch.full((4, 32), big, dtype=dtype)
    x[1::2] *= -1
    t = fp4stack.quantize(x)
    assert t.amax.item() == big
    assert (t.scales.float() == 448.0).all()
    codes = torch.stack((t.data & 15, t.data >> 4), -1)
    assert ((codes & 7) == 7).all()  # every element maps to +-6
    y = fp4stack.dequantize(t, dtype)
    assert torch.isfinite(y).all()
    assert torch.equal(y, x)
    assert torch.isfinite(fp4stack.dequantize(t, torch.float32)).all()


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_finfo_max_next_to_ordinary_values(dtype):
    x = randn(8, 64, seed=1, dtype=dtype)
    x[5, 7] = torch.finfo(dtype).max
    y = fp4stack.fake_quantize(x)
    assert torch.isfinite(y).all()
    assert y[5, 7] == x[5, 7]
    oracle_check(x, fp4stack.quantize(x))


def test_single_huge_outlier():
    x = randn(64, 256, seed=2)
    x[10, 100] = 1e4
    t = fp4stack.quantize(x)
    y = fp4stack.dequantize(t)
    assert t.amax.item() == 1e4
    assert abs(y[10, 100].item() - 1e4) <= 1e4 * 2**-22
    assert torch.isfinite(y).all()
    # The outlier's block is crushed; every other block keeps NVFP4-level accuracy.
    outside = torch.ones_like(x, dtype=torch.bool)
    outside[10, 96:112] = False
    err = (y - x)[outside].norm() / x[outside].norm()
    assert err < 0.2
    oracle_check(x, t)


def test_per_row_dynamic_range_gives_subnormal_scales():
    mag = torch.logspace(-6, 3, 32, dtype=torch.float64)[:, None]
    x = (randn(32, 64, seed=3).double() * mag).float()
    t = fp4stack.quantize(x)
    s = t.scales.float()
    assert ((s > 0) & (s < 2.0**-6)).any(), "expected subnormal E4M3 block scales"
    assert (s == 0).any(), "expected block scales that underflow to zero"
    oracle_check(x, t)
    # Rows whose scales stay normal keep the usual relative error.
    y = fp4stack.dequantize(t)
    normal_rows = (s >= 2.0**-6).all(dim=1)
    assert normal_rows.sum() >= 8
    rel = (y - x)[normal_rows].norm(dim=1) / x[normal_rows].norm(dim=1)
    assert (rel < 0.2).all()


TIE_POINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def spec_round(y: float) -> float:
    """E2M1 RNE value of y in [-6, 6] straight from the spec's table."""
    a = abs(y)
    table = [(0.25, True, 0.0), (0.75, False, 0.5), (1.25, True, 1.0), (1.75, False, 1.5),
             (2.5, True, 2.0), (3.5, False, 3.0), (5.0, True, 4.0)]
    for bound, inclusive, val in table:
        if a < bound or (inclusive and a == bound):
            return float(np.copysign(val, y))
    return float(np.copysign(6.0, y))


@pytest.mark.parametrize("scale_exp", [8, 3, 0, -4, -6, -7, -9])
@pytest.mark.parametrize("delta", [0.0, 1e-3, -1e-3])
def test_boundary_values_around_ties(scale_exp, delta):
    # amax = 2688 * 2^-10 makes S_enc = 2^10 and S_dec = 2^-10 exact; a block whose max is
    # 6 * 2^e * S_dec gets the E4M3 scale 2^e exactly (subnormal for e < -6), and its elements
    # v * 2^e * S_dec are scaled to exactly v. So y sits on (or 1e-3 beside) each tie point.
    s_dec = 2.0**-10
    step = 2.0**scale_exp * s_dec
    vals = [float(np.float32(v + delta)) for v in TIE_POINTS]
    row = [6.0] + vals + [-v for v in vals] + [0.0]
    x = torch.tensor([[2688 * s_dec] + [0.0] * 15, [r * step for r in row]], dtype=torch.float32)
    t = fp4stack.quantize(x)
    assert t.scales[1, 0].float().item() == 2.0**scale_exp
    got = (fp4stack.dequantize(t)[1] / step).tolist()
    assert got == [spec_round(v) for v in row]
    oracle_check(x, t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_ties_in_every_dtype(dtype):
    # Tie points and the block max 6 are exact in bf16 and fp16 too. With x = v * 2^-3 and the
    # imposed amax 336 (S_enc = 8, exact), the block scale is 1 and y = 8 * x = v exactly.
    row = [6.0, *TIE_POINTS, *(-v for v in TIE_POINTS), 0.0]
    x = torch.tensor([row], dtype=dtype) * 2.0**-3
    t = fp4stack.quantize(x, amax=336.0)
    assert t.scales.float()[0, 0].item() == 1.0
    y = fp4stack.dequantize(t, torch.float32)
    assert (y[0] / 2.0**-3).tolist() == [spec_round(v) for v in row]
    oracle_check(x, t, amax=336.0)


@pytest.mark.parametrize("opts", [{}, {"block": (16, 16)}, {"hadamard": True}])
def test_nonfinite_raises_naming_tensor_and_count(opts):
    x = randn(4, 32, seed=4)
    x[0, 1] = float("nan")
    x[2, 5] = float("inf")
    x[3, 31] = -float("inf")
    with pytest.raises(ValueError, match=r"wq_proj: 3 of 128 values are NaN or Inf"):
        fp4stack.quantize(x, name="wq_proj", **opts)
    with pytest.raises(ValueError, match=r"dY: 3 of 128"):
        fp4stack.fake_quantize(x, name="dY", **opts)


def test_nan_propagate_does_not_raise_and_stays_local_with_imposed_amax():
    x = randn(4, 48, seed=5)
    amax = float(x.abs().max())
    x_nan = x.clone()
    x_nan[1, 20] = float("nan")
    t = fp4stack.quantize(x_nan, nan_policy="propagate", amax=amax)
    ref = fp4stack.quantize(x, amax=amax)
    bad = torch.zeros(4, 3, dtype=torch.bool)
    bad[1, 1] = True
    assert t.scales.view(torch.uint8)[1, 1].item() == 0x7F  # the canonical E4M3 NaN
    s, s_ref = t.scales.view(torch.uint8), ref.scales.view(torch.uint8)
    assert torch.equal(s[~bad], s_ref[~bad])
    y = fp4stack.dequantize(t)
    assert torch.isnan(y[1, 16:32]).all()
    assert torch.equal(y[~torch.isnan(y)], fp4stack.dequantize(ref)[~torch.isnan(y)])
    # Without an imposed amax the NaN reaches the global scale: no error, NaN everywhere.
    t2 = fp4stack.quantize(x_nan, nan_policy="propagate")
    assert torch.isnan(t2.amax)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5,), (3, 17), (2, 3, 33), (2, 1, 4, 100), (7, 16), (1, 1)])
def test_shapes_and_dtypes(dtype, shape):
    x = randn(*shape, seed=6, dtype=dtype)
    t = fp4stack.quantize(x)
    kb = -(-shape[-1] // 16)
    assert t.shape == x.shape
    assert t.data.shape == (*shape[:-1], kb * 8) and t.data.dtype == torch.uint8
    assert t.scales.shape == (*shape[:-1], kb) and t.scales.dtype == torch.float8_e4m3fn
    assert t.amax.shape == () and t.amax.dtype == torch.float32
    y = fp4stack.dequantize(t, dtype)
    assert y.shape == x.shape and y.dtype == dtype
    assert fp4stack.dequantize(t).dtype == torch.float32
    # Padding K with zeros changes nothing: same bytes, same values.
    kp = kb * 16
    tp = fp4stack.quantize(torch.nn.functional.pad(x, (0, kp - shape[-1])))
    assert torch.equal(t.data, tp.data) and torch.equal(t.scales, tp.scales)
    assert torch.equal(y, fp4stack.dequantize(tp, dtype)[..., : shape[-1]])


@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
def test_leading_dims_are_independent_given_the_amax(block):
    x = randn(2, 3, 20, 40, seed=7)
    amax = x.abs().max()
    t = fp4stack.quantize(x, block=block)
    for i, j in itertools.product(range(2), range(3)):
        ti = fp4stack.quantize(x[i, j], block=block, amax=amax)
        assert torch.equal(t.data[i, j], ti.data)
        assert torch.equal(t.scales[i, j].view(torch.uint8), ti.scales.view(torch.uint8))
    if block == (1, 16):
        flat = fp4stack.quantize(x.reshape(-1, 40))
        assert torch.equal(flat.data.reshape(t.data.shape), t.data)


@pytest.mark.parametrize(
    "shape,block",
    [((0, 20), (1, 16)), ((5, 0), (1, 16)), ((2, 0, 7), (1, 16)), ((0,), (1, 16)),
     ((0, 20), (16, 16)), ((5, 0), (16, 16)), ((2, 0, 7), (16, 16))],
)
def test_empty_tensors(shape, block):
    x = torch.zeros(shape)
    t = fp4stack.quantize(x, block=block)
    assert t.amax.item() == 0.0
    y = fp4stack.dequantize(t)
    assert y.shape == x.shape
    assert fp4stack.fake_quantize(x, block=block).shape == x.shape


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_relative_frobenius_error_on_randn(dtype):
    x = randn(1024, 1024, seed=8, dtype=dtype).float()
    err = (fp4stack.fake_quantize(x) - x).norm() / x.norm()
    assert 0.085 < err < 0.105, err


def test_error_ordering_of_options():
    x = randn(256, 512, seed=9)

    def err(**kw):
        return ((fp4stack.fake_quantize(x, **kw) - x).norm() / x.norm()).item()

    rne = err()
    assert err(four_over_six=True) < rne  # keeps the better of two candidates per block
    assert rne < err(block=(16, 16)) < 0.13  # a tile's max is at least its rows' max
    assert rne < err(rounding="stochastic", seed=0) < 0.16  # unbiased, but noisier


# ----------------------------------------------------------------------------------------------
# Differential identities.
# ----------------------------------------------------------------------------------------------
OPTION_GRID = [
    dict(block=b, rounding=r, hadamard=h, four_over_six=f)
    for b, r, h, f in itertools.product(
        [(1, 16), (16, 16)], ["rne", "stochastic"], [False, True], [False, True]
    )
    if not (h and b == (16, 16))
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opts", OPTION_GRID, ids=lambda o: "-".join(f"{v}" for v in o.values()))
@pytest.mark.parametrize("amax", [None, 7.5])
def test_fake_quantize_is_dequantize_of_quantize(dtype, opts, amax):
    x = randn(2, 24, 48, seed=10, dtype=dtype) * 2
    seed = 11 if opts["rounding"] == "stochastic" else None
    fq = fp4stack.fake_quantize(x, amax=amax, seed=seed, **opts)
    dq = fp4stack.dequantize(fp4stack.quantize(x, amax=amax, seed=seed, **opts), dtype)
    assert fq.dtype == dtype and fq.shape == x.shape
    assert torch.equal(fq.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       dq.view(torch.int16 if dtype != torch.float32 else torch.int32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opts", OPTION_GRID, ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_straight_through_gradient(dtype, opts):
    x = randn(3, 32, seed=12, dtype=dtype).requires_grad_()
    g = randn(3, 32, seed=13, dtype=dtype)
    y = fp4stack.fake_quantize(x, seed=1, **opts)
    y.backward(g)
    assert x.grad.dtype == dtype
    if not opts["hadamard"]:
        assert torch.equal(x.grad, g)
    else:
        # d/dx <g, rht(x)> by autograd through the (differentiable) torch transform.
        xf = x.detach().float().requires_grad_()
        (rht(xf) * g.float()).sum().backward()
        expected = xf.grad.to(dtype)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(x.grad, expected, atol=tol, rtol=tol)
        assert torch.equal(x.grad, fp4stack.rht_inverse(g).to(dtype))


@pytest.mark.parametrize("four_over_six", [False, True])
@pytest.mark.parametrize("shape", [(32, 48), (17, 33), (5, 70), (40, 16), (2, 19, 35)])
def test_2d_tiles_commute_with_transpose(shape, four_over_six):
    w = randn(*shape, seed=14)
    a = fp4stack.dequantize(fp4stack.quantize(w, block=(16, 16), four_over_six=four_over_six))
    b = fp4stack.dequantize(
        fp4stack.quantize(w.mT.contiguous(), block=(16, 16), four_over_six=four_over_six)
    )
    assert torch.equal(a.mT, b)


@pytest.mark.parametrize("four_over_six", [False, True])
def test_2d_scale_shared_by_the_16_rows_of_a_tile(four_over_six):
    t = fp4stack.quantize(randn(40, 50, seed=15), block=(16, 16), four_over_six=four_over_six)
    s = t.scales.view(torch.uint8)
    for r0 in range(0, 40, 16):
        tile = s[r0 : r0 + 16]
        assert (tile == tile[:1]).all()
    # and it is the 1x16 scale of the tile's largest row block
    t1 = fp4stack.quantize(randn(40, 50, seed=15), four_over_six=four_over_six)
    if not four_over_six:
        for r0 in range(0, 40, 16):
            tile_max = t1.scales.float()[r0 : r0 + 16].amax(dim=0)
            assert torch.equal(t.scales.float()[r0], tile_max)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(24, 40), (3, 17, 33)])
def test_columnwise_is_quantizing_the_transpose(dtype, shape):
    x = randn(*shape, seed=16, dtype=dtype)
    t = fp4stack.quantize(x, columnwise=True)
    assert t.shape == x.mT.shape
    assert_same_nvfp4(t, fp4stack.quantize(x.mT.contiguous()))
    assert_same_nvfp4(
        fp4stack.quantize(x, columnwise=True, rounding="stochastic", seed=5),
        fp4stack.quantize(x.mT, rounding="stochastic", seed=5),
    )
    with pytest.raises(ValueError, match="columnwise"):
        fp4stack.quantize(x.reshape(-1), columnwise=True)


def test_noncontiguous_input_is_the_same_as_contiguous():
    x = randn(48, 40, seed=17)
    assert_same_nvfp4(fp4stack.quantize(x.T), fp4stack.quantize(x.T.contiguous()))
    assert_same_nvfp4(fp4stack.quantize(x[:, ::2]), fp4stack.quantize(x[:, ::2].contiguous()))


@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
@pytest.mark.parametrize("four_over_six", [False, True])
def test_shared_amax_of_fused_projections(block, four_over_six):
    # vLLM-style fused q/k/v: quantizing each part with the shared amax (the max over the parts)
    # gives exactly the rows of the fused tensor's quantization.
    q, k, v = randn(32, 48, seed=18), randn(16, 48, seed=19) * 3, randn(16, 48, seed=20) * 0.1
    fused = fp4stack.quantize(torch.cat([q, k, v]), block=block, four_over_six=four_over_six)
    amax = torch.stack([p.abs().max() for p in (q, k, v)]).max()
    rows = 0
    for p in (q, k, v):
        tp = fp4stack.quantize(p, amax=amax, block=block, four_over_six=four_over_six)
        assert tp.amax.item() == amax.item() == fused.amax.item()
        assert torch.equal(tp.data, fused.data[rows : rows + p.shape[0]])
        assert torch.equal(tp.scales, fused.scales[rows : rows + p.shape[0]])
        rows += p.shape[0]


def test_amax_smaller_than_the_tensor_saturates():
    x = randn(8, 64, seed=21)
    amax = 0.25 * x.abs().max().item()
    t = fp4stack.quantize(x, amax=amax)
    y = fp4stack.dequantize(t)
    assert t.amax.item() == np.float32(amax)
    assert t.scales.float().max().item() == 448.0
    assert y.abs().max().item() <= amax * (1 + 1e-6)
    oracle_check(x, t, amax=amax)


@pytest.mark.parametrize(
    "amax,match",
    [(-1.0, "amax"), (float("nan"), "amax"), (float("inf"), "amax"),
     (torch.tensor([1.0, 2.0]), "amax must be a scalar")],
)
def test_invalid_amax(amax, match):
    with pytest.raises(ValueError, match=match):
        fp4stack.quantize(randn(4, 32), amax=amax)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_invalid_amax_tensor_checked_unless_propagating(bad):
    x = randn(4, 32)
    with pytest.raises(ValueError, match="amax must be finite and >= 0"):
        fp4stack.quantize(x, amax=torch.tensor(bad))
    # "propagate" trusts a tensor amax (reading it would cost a host sync on a GPU).
    fp4stack.quantize(x, amax=torch.tensor(bad), nan_policy="propagate")


# ----------------------------------------------------------------------------------------------
# Validation of options and inputs.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"block": (2, 16)}, ValueError, r"block"),
        ({"block": (16, 1)}, ValueError, r"block"),
        ({"rounding": "foo"}, ValueError, r"rounding.*'foo'"),
        ({"nan_policy": "ignore"}, ValueError, r"nan_policy"),
        ({"hadamard": True, "block": (16, 16)}, ValueError, r"hadamard"),
        ({"four_over_six": "yes"}, ValueError, r"four_over_six"),
        ({"hadamard": 1}, ValueError, r"hadamard"),
    ],
)
def test_invalid_options(kwargs, exc, match):
    x = randn(32, 32)
    with pytest.raises(exc, match=match):
        fp4stack.quantize(x, **kwargs)
    with pytest.raises(exc, match=match):
        fp4stack.fake_quantize(x, **kwargs)


def test_hadamard_needs_k_multiple_of_16():
    with pytest.raises(ValueError, match=r"x_t: hadamard=True.*multiple of 16.*20"):
        fp4stack.quantize(randn(4, 20), hadamard=True, name="x_t")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.float64, torch.bool])
def test_non_float_input_rejected(dtype):
    with pytest.raises(TypeError, match=rf"w1: .*{dtype}"):
        fp4stack.quantize(torch.ones(4, 16, dtype=dtype), name="w1")


def test_2d_block_needs_two_dims_and_non_tensor_rejected():
    with pytest.raises(ValueError, match=r"block=\(16, 16\).*2 dims"):
        fp4stack.quantize(randn(32), block=(16, 16))
    # (The reference's check; fp4stack.quantize itself reads x.device before reaching it.)
    with pytest.raises(TypeError, match="torch.Tensor"):
        reference.quantize(np.ones((4, 16), np.float32))
    with pytest.raises(TypeError, match="NVFP4Tensor"):
        fp4stack.dequantize(randn(4, 16))


def test_spec_object_and_options_agree():
    x = randn(32, 48, seed=22)
    for spec in (QuantSpec(), QuantSpec(block=[16, 16], four_over_six=True),
                 QuantSpec(hadamard=True), QuantSpec(rounding="stochastic")):
        opts = dict(block=spec.block, rounding=spec.rounding, hadamard=spec.hadamard,
                    four_over_six=spec.four_over_six)
        a = fp4stack.quantize(x, spec=spec, seed=4)
        assert a.spec == spec
        assert_same_nvfp4(a, fp4stack.quantize(x, seed=4, **opts))
        assert torch.equal(fp4stack.fake_quantize(x, spec=spec, seed=4),
                           fp4stack.fake_quantize(x, seed=4, **opts))


@pytest.mark.parametrize("option", [{"block": (16, 16)}, {"rounding": "stochastic"},
                                    {"hadamard": True}, {"four_over_six": True},
                                    {"nan_policy": "propagate"}])
def test_spec_conflicting_with_options(option):
    with pytest.raises(ValueError, match="either spec="):
        fp4stack.quantize(randn(16, 32), spec=QuantSpec(), **option)
    with pytest.raises(ValueError, match="either spec="):
        fp4stack.fake_quantize(randn(16, 32), spec=QuantSpec(), **option)


def test_quantspec_value_semantics():
    assert QuantSpec(block=[16, 16]) == QuantSpec(block=(16, 16))
    assert QuantSpec(four_over_six=True).scale_max == 256.0
    assert QuantSpec().scale_max == 448.0
    assert QuantSpec(block=(16, 16)).is_2d and not QuantSpec().is_2d
    d = QuantSpec(block=(16, 16), rounding="stochastic").to_dict()
    assert d["block"] == [16, 16]
    assert QuantSpec(**{**d, "block": tuple(d["block"])}) == QuantSpec(block=(16, 16),
                                                                         rounding="stochastic")
    with pytest.raises(AttributeError):
        QuantSpec().rounding = "stochastic"
