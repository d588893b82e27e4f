"""The Triton NVFP4 attention forward against the torch reference.

Its in-kernel Q̂, K̂, V̂ tiles equal fp4stack.fake_quantize bit for bit; its output and lse equal
fp4_attention's within the summation-order error of the online softmax. Measured on CPU with fp32
inputs over the cases below: output max abs error 7.2e-7 (max rel 2.6e-5 where |ref| > 1e-2),
lse max abs error 7.2e-7. On CPU the kernel runs under the Triton interpreter at small sizes,
with small tiles so that several query and key tiles and the tails are exercised.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from fp4stack import fake_quantize
from fp4stack.nn.attention import NVFP4_RNE, AttentionQuant, fp4_attention

pytest.importorskip("triton")
from fp4stack.kernels.attention import fp4_attention_forward, quantized_operands  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
SMALL = dict(block_m=16, block_n=16) if not CUDA else {}
# fp32 inputs: only the order of the sums differs from the reference (measured <= 7.2e-7).
FP32_TOL = dict(atol=2e-6, rtol=1e-5)


@pytest.fixture(autouse=True)
def _quiet_numpy():
    # The interpreter runs on numpy: an all-zero padding block divides by a zero scale, which
    # the kernel then clamps (as the reference does); numpy warns about it all the same.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def draw(B, H, S, L, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, d, generator=g) for n in (S, L, L))
    return [t.to(DEVICE, dtype) for t in (q, k, v)]


def fq_along(x: torch.Tensor, dim: int, amax) -> torch.Tensor:
    """fake_quantize in 1x16 blocks along `dim`, zero-padded to whole blocks, with `amax`."""
    y = x.float().movedim(dim, -1)
    n = y.shape[-1]
    y = F.pad(y, (0, -n % 16))
    y = fake_quantize(y.contiguous(), spec=NVFP4_RNE, amax=amax)
    return y[..., :n].movedim(-1, dim)


def reference_lse(q, k, v, causal, amaxes):
    """log-sum-exp of the reference's scaled scores (quantized Q̂ K̂ᵀ, fp32, masked)."""
    qh, kh = fq_along(q, -1, amaxes[0]), fq_along(k, -1, amaxes[1])
    s = (qh @ kh.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    S, L = q.shape[2], k.shape[2]
    if causal:
        allowed = torch.ones(S, L, dtype=torch.bool, device=q.device).tril(L - S)
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.logsumexp(s, dim=-1)


def amaxes_of(*ts):
    return [t.float().abs().amax() for t in ts]


@pytest.mark.parametrize("S, L, d, block_n", [(17, 17, 16, 16), (33, 40, 64, 32),
                                              (5, 33, 16, 64)])
def test_tiles_bit_exact(S, L, d, block_n):
    q, k, v = draw(2, 2, S, L, d, seed=1)
    k[0, 1, 3, :] *= 50  # a block max far from the others
    qa, ka, va = amaxes_of(q, k, v)
    va = va * 3  # a caller's amax that is not this tensor's own is used as given
    qh, kh, vh = quantized_operands(q, k, v, q_amax=qa, k_amax=ka, v_amax=va, block_m=16,
                                    block_n=block_n)
    assert torch.equal(qh, fq_along(q, -1, qa))
    assert torch.equal(kh, fq_along(k, -1, ka))
    assert torch.equal(vh, fq_along(v, -2, va))  # blocks of 16 keys, the tail zero-padded


def test_tiles_causal_visited_bit_exact():
    # Causal programs skip key tiles above the diagonal; those they visit hold the same values.
    q, k, v = draw(1, 2, 20, 37, 16, seed=2)
    _, kh, vh = quantized_operands(q, k, v, causal=True, block_m=16, block_n=16)
    seen = ~torch.isnan(kh)
    assert seen.any()
    assert torch.equal(kh[seen], fq_along(k, -1, k.abs().amax())[seen])
    assert torch.equal(vh[seen], fq_along(v, -2, v.abs().amax())[seen])


CASES = [(17, 17), (33, 33), (5, 33), (1, 17), (16, 16)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("S, L", CASES)
@pytest.mark.parametrize("d", [16, 64])
def test_forward_matches_reference(S, L, d, causal):
    q, k, v = draw(2, 2, S, L, d, seed=S * 100 + L + d)
    amaxes = amaxes_of(q, k, v)
    out, lse = fp4_attention_forward(q, k, v, causal, q_amax=amaxes[0], k_amax=amaxes[1],
                                     v_amax=amaxes[2], **SMALL)
    want = fp4_attention(q, k, v, causal, AttentionQuant.paper())
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == (2, 2, S)
    torch.testing.assert_close(out, want, **FP32_TOL)
    torch.testing.assert_close(lse, reference_lse(q, k, v, causal, amaxes), **FP32_TOL)


def test_amax_default_and_scale():
    q, k, v = draw(1, 2, 17, 17, 32, seed=3)
    out, _ = fp4_attention_forward(q, k, v, False, scale=0.3, **SMALL)
    want = fp4_attention(q, k, v, False, AttentionQuant.paper(), scale=0.3)
    torch.testing.assert_close(out, want, **FP32_TOL)


def test_bf16_small():
    # 16-bit inputs: P goes into the PV dot as bf16 and the output is bf16 (measured 5.3e-3).
    q, k, v = draw(1, 2, 17, 33, 32, dtype=torch.bfloat16, seed=5)
    out, lse = fp4_attention_forward(q, k, v, True, **SMALL)
    want = fp4_attention(q.float(), k.float(), v.float(), True, AttentionQuant.paper())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, reference_lse(q, k, v, True, amaxes_of(q, k, v)),
                               **FP32_TOL)


def test_rejects_bad_shapes():
    q, k, v = draw(1, 2, 8, 8, 16)
    with pytest.raises(ValueError):
        fp4_attention_forward(q[..., :8], k[..., :8], v[..., :8])
    with pytest.raises(ValueError):
        fp4_attention_forward(q, k[:, :1], v[:, :1])  # GQA heads must be repeated first
    with pytest.raises(ValueError):
        fp4_attention_forward(q, k[:, :, :4], v[:, :, :4], causal=True)  # S > L


@gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("S, L, d", [(1000, 1000, 128), (257, 1300, 64), (511, 511, 32)])
def test_gpu_bf16_large(S, L, d, causal):
    q, k, v = draw(2, 4, S, L, d, dtype=torch.bfloat16, seed=4)
    qh, kh, vh = quantized_operands(q, k, v)
    qa, ka, va = amaxes_of(q, k, v)
    assert torch.equal(qh, fq_along(q, -1, qa))
    assert torch.equal(kh, fq_along(k, -1, ka))
    assert torch.equal(vh, fq_along(v, -2, va))
    out, lse = fp4_attention_forward(q, k, v, causal, q_amax=qa, k_amax=ka, v_amax=va)
    want = fp4_attention(q.float(), k.float(), v.float(), causal, AttentionQuant.paper())
    # bf16 P in the PV dot and a bf16 output: errors of bf16's 2**-8 relative size.
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, reference_lse(q, k, v, causal, (qa, ka, va)),
                               atol=1e-4, rtol=1e-5)
