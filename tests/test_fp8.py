"""FP8 E4M3 baselines: scale = amax / 448 (1 where amax == 0) per tensor, row or 1x128 block;
data = e4m3_rne(clamp(x / scale, -448, 448)); x_hat = data * scale; float32 throughout."""

import numpy as np
import pytest
import spec_oracle as oracle
import torch

import fp4stack

GRANULARITIES = ("tensor", "row", "block128")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def randn(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def direct_fp8(x: torch.Tensor, granularity: str):
    """The formula, element by element on numpy float32 scalars: (data bytes, scales, x_hat)."""
    xs = x.float().numpy()
    k = xs.shape[-1]
    rows = xs.reshape(-1, k)
    kp = -(-k // 128) * 128 if granularity == "block128" else k
    groups = {  # which [row, column range] shares one scale
        "tensor": lambda r, c: 0,
        "row": lambda r, c: r,
        "block128": lambda r, c: (r, c // 128),
    }[granularity]
    amax = {}
    for r, row in enumerate(rows):
        for c in range(kp):
            v = abs(np.float32(row[c])) if c < k else np.float32(0)
            key = groups(r, c)
            amax[key] = max(amax.get(key, np.float32(0)), v)
    scale = {key: np.float32(1) if a == 0 else np.float32(a) / np.float32(448)
             for key, a in amax.items()}
    data = np.zeros((len(rows), kp), np.uint8)
    xhat = np.zeros((len(rows), k), np.float32)
    for r, row in enumerate(rows):
        for c in range(kp):
            v = np.float32(row[c]) if c < k else np.float32(0)
            s = scale[groups(r, c)]
            q = np.float32(v) / s
            q = np.float32(min(max(q, np.float32(-448)), np.float32(448)))
            data[r, c] = oracle.e4m3_rne(q)
            if c < k:
                xhat[r, c] = np.float32(oracle.e4m3_byte_to_float(int(data[r, c]))) * s
    return data.reshape(*xs.shape[:-1], kp), scale, xhat.reshape(xs.shape)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 40), (2, 3, 200), (300,)])
def test_matches_the_direct_formula(granularity, dtype, shape):
    x = randn(*shape, seed=1, dtype=dtype) * torch.logspace(-2, 2, shape[-1]).to(dtype)
    t = fp4stack.quantize_fp8(x, granularity)
    data, scales, xhat = direct_fp8(x, granularity)
    np.testing.assert_array_equal(t.data.view(torch.uint8).numpy(), data)
    if granularity == "tensor":
        assert t.scale.shape == () and np.float32(t.scale.item()) == scales[0]
    elif granularity == "row":
        assert t.scale.shape == (*shape[:-1], 1)
        np.testing.assert_array_equal(t.scale.reshape(-1).numpy(),
                                      [scales[r] for r in range(len(scales))])
    else:
        kb = -(-shape[-1] // 128)
        assert t.scale.shape == (*shape[:-1], kb)
        want = [[scales[r, b] for b in range(kb)] for r in range(t.scale.numel() // kb)]
        np.testing.assert_array_equal(t.scale.reshape(-1, kb).numpy(), np.array(want))
    y = fp4stack.dequantize_fp8(t)
    assert y.shape == x.shape and y.dtype == torch.float32
    np.testing.assert_array_equal(y.numpy(), xhat)
    fq = fp4stack.fake_quantize_fp8(x, granularity)
    assert fq.dtype == dtype and torch.equal(fq, y.to(dtype))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_all_zero(granularity):
    t = fp4stack.quantize_fp8(torch.zeros(3, 130), granularity)
    assert (t.scale == 1).all()
    assert (t.data.view(torch.uint8) == 0).all()
    assert torch.equal(fp4stack.dequantize_fp8(t), torch.zeros(3, 130))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_zero_rows_next_to_nonzero_rows(granularity):
    x = randn(4, 256, seed=2)
    x[1] = 0
    y = fp4stack.fake_quantize_fp8(x, granularity)
    assert torch.isfinite(y).all() and (y[1] == 0).all()


@pytest.mark.parametrize("k", [1, 127, 129, 300])
def test_block128_pads_k_and_restores_shape(k):
    x = randn(3, k, seed=3)
    t = fp4stack.quantize_fp8(x, "block128")
    kp = -(-k // 128) * 128
    assert t.data.shape == (3, kp) and t.scale.shape == (3, kp // 128)
    assert (t.data[:, k:].view(torch.uint8) == 0).all()
    assert fp4stack.dequantize_fp8(t).shape == x.shape
    # the padding is invisible: quantizing the zero-padded tensor gives the same bytes
    tp = fp4stack.quantize_fp8(torch.nn.functional.pad(x, (0, kp - k)), "block128")
    assert torch.equal(t.data.view(torch.uint8), tp.data.view(torch.uint8))


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("shape", [(0, 200), (5, 0), (0,)])
def test_empty(granularity, shape):
    x = torch.zeros(shape)
    assert fp4stack.fake_quantize_fp8(x, granularity).shape == x.shape


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_error_small_on_randn(granularity):
    x = randn(512, 512, seed=4)
    err = (fp4stack.fake_quantize_fp8(x, granularity) - x).norm() / x.norm()
    assert err < 0.035, err  # 3 mantissa bits: ~2.6% rms relative error
    assert (fp4stack.fake_quantize_fp8(x, granularity) - x).norm() < (
        fp4stack.fake_quantize(x) - x).norm() / 2  # far below NVFP4's


def test_finer_granularity_helps_with_outliers():
    x = randn(64, 512, seed=5)
    x[0, 0] = 1e4

    def err(g):
        return ((fp4stack.fake_quantize_fp8(x, g) - x)[1:].norm() / x[1:].norm()).item()

    assert err("block128") <= err("row") < err("tensor")


def test_invalid_arguments():
    with pytest.raises(ValueError, match="granularity"):
        fp4stack.quantize_fp8(randn(4, 16), "block32")
    with pytest.raises(ValueError, match="at least one dim"):
        fp4stack.quantize_fp8(torch.tensor(1.0))
