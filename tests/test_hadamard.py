"""16-point random Hadamard transform: the matrix, the fast transform, its inverse, and its use
with quantization (values stay in the transformed domain; the transform cancels in a GEMM)."""

import numpy as np
import pytest
import torch

import fp4stack
from fp4stack.formats import hadamard

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = [(16,), (3, 32), (2, 5, 48), (1, 1, 2, 64)]


def randn(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def test_h16_is_the_sylvester_matrix():
    h2 = np.array([[1, 1], [1, -1]])
    want = np.kron(np.kron(np.kron(h2, h2), h2), h2)
    h = hadamard.hadamard_matrix(16)
    np.testing.assert_array_equal(h.numpy(), want)
    assert torch.equal(h @ h.T, 16 * torch.eye(16))


def test_rht_matrix_is_orthogonal_and_signed_hadamard():
    m = hadamard.rht_matrix()
    assert m.dtype == torch.float32 and m.shape == (16, 16)
    assert torch.equal(m @ m.T, torch.eye(16))  # exact: entries are +-1/4
    assert torch.equal(m.T @ m, torch.eye(16))
    signs = torch.tensor(hadamard.RHT_SIGNS, dtype=torch.float32)
    assert set(signs.tolist()) == {-1.0, 1.0}
    assert torch.equal(m, torch.diag(signs) @ hadamard.hadamard_matrix(16) / 4)


def test_sign_vector_is_part_of_the_format():
    # Changing the signs changes every transformed value (and any tensor stored with hadamard).
    assert hadamard.RHT_SIGNS == (1, -1, 1, 1, -1, 1, -1, -1, 1, 1, -1, 1, -1, -1, -1, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rht_is_blockwise_product_with_the_matrix(dtype, shape):
    x = randn(*shape, seed=1, dtype=dtype)
    y = fp4stack.rht(x)
    assert y.dtype == torch.float32 and y.shape == x.shape
    want = (x.float().reshape(-1, 16) @ hadamard.rht_matrix()).reshape(shape)
    torch.testing.assert_close(y, want, atol=1e-6, rtol=1e-6)


def fwht_scalar(block):
    """x · diag(s) · H16 / 4 on numpy float32 scalars, butterflies at distance 8, 4, 2, 1."""
    v = [np.float32(a) * np.float32(s) for a, s in zip(block, hadamard.RHT_SIGNS, strict=True)]
    d = 8
    while d >= 1:
        out = list(v)
        for start in range(0, 16, 2 * d):
            for j in range(start, start + d):
                out[j], out[j + d] = v[j] + v[j + d], v[j] - v[j + d]
        v, d = out, d // 2
    return [a * np.float32(0.25) for a in v]


def test_rht_follows_the_documented_butterfly_order_bit_for_bit():
    # Kernels must reproduce the reference's additions exactly; pin the order down.
    x = randn(8, 64, seed=2) * torch.logspace(-3, 3, 64)
    got = fp4stack.rht(x).numpy().reshape(-1, 16)
    want = np.array([fwht_scalar(b) for b in x.numpy().reshape(-1, 16)], np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("shape", SHAPES)
def test_inverse(shape):
    x = randn(*shape, seed=3)
    torch.testing.assert_close(fp4stack.rht_inverse(fp4stack.rht(x)), x, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fp4stack.rht(fp4stack.rht_inverse(x)), x, atol=1e-6, rtol=1e-5)
    want = (x.reshape(-1, 16) @ hadamard.rht_matrix().T).reshape(shape)
    torch.testing.assert_close(fp4stack.rht_inverse(x), want, atol=1e-6, rtol=1e-6)


def test_preserves_block_norms():
    x = randn(10, 64, seed=4)
    n0 = x.reshape(-1, 16).norm(dim=-1)
    n1 = fp4stack.rht(x).reshape(-1, 16).norm(dim=-1)
    torch.testing.assert_close(n0, n1, rtol=1e-5, atol=0)


def test_cancels_in_a_gemm():
    a, b = randn(24, 64, seed=5), randn(40, 64, seed=6)
    torch.testing.assert_close(fp4stack.rht(a) @ fp4stack.rht(b).T, a @ b.T,
                               atol=1e-4, rtol=1e-4)


def test_quantized_gemm_with_hadamard_approximates_the_product():
    # Wgrad-style: both operands transformed and quantized; the product needs no inverse.
    a, b = randn(32, 256, seed=7), randn(48, 256, seed=8)
    qa = fp4stack.fake_quantize(a, hadamard=True)
    qb = fp4stack.fake_quantize(b, hadamard=True)
    ref = a @ b.T
    err = (qa @ qb.T - ref).norm() / ref.norm()
    assert err < 0.25, err


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_stores_the_transformed_domain(dtype):
    x = randn(64, 128, seed=9, dtype=dtype)
    t = fp4stack.quantize(x, hadamard=True)
    assert t.spec.hadamard
    y = fp4stack.dequantize(t)
    hx = fp4stack.rht(x)
    assert t.amax.item() == hx.abs().max().item()  # amax taken after the transform
    assert (y - hx).norm() / hx.norm() < 0.105
    assert (y - x.float()).norm() / x.float().norm() > 0.5  # not the original domain
    back = fp4stack.rht_inverse(y)
    assert (back - x.float()).norm() / x.float().norm() < 0.105


@pytest.mark.parametrize("fn", [fp4stack.rht, fp4stack.rht_inverse])
def test_rejects_k_not_multiple_of_16(fn):
    with pytest.raises(ValueError, match="multiple of 16"):
        fn(randn(4, 24))
