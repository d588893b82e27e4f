"""The w8a8 GEMM (kernels/fp8_gemm.py): emulated on CPU, native FP8 block-scaled on CUDA.

On CPU `fp8_linear` must be exactly the fake-quantized GEMM the trainer's w8a8 path computes.
On a GPU with block-scaled scaled_mm the native GEMM skips the BF16 rounding of each dequantized
operand; it is bounded against the emulated one by that rounding (2^-8 relative per product,
plus the BF16 output's 2^-9).
"""

import pytest
import torch

from fp4stack.formats.fp8 import dequantize_fp8, fake_quantize_fp8
from fp4stack.kernels.fp8_gemm import fp8_linear, fp8_weight, native_block_fp8

CUDA = torch.cuda.is_available()


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("m,n,k", [(1, 32, 128), (5, 48, 200), (16, 16, 384)])
def test_cpu_is_the_fake_quantized_gemm(m, n, k):
    x, w, b = randn(m, k), randn(n, k, seed=1), randn(n, seed=2)
    want = fake_quantize_fp8(x, "block128") @ fake_quantize_fp8(w, "block128").t() + b
    assert torch.equal(fp8_linear(x, fp8_weight(w), b), want)


def test_cached_weight_scales_are_column_major_and_unchanged():
    w = randn(48, 256)
    q = fp8_weight(w)
    assert q.scale.stride() == (1, 48)
    assert torch.equal(dequantize_fp8(q), fake_quantize_fp8(w, "block128"))


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("m", [1, 16, 37, 256])
def test_native_gemm_is_the_emulated_one_up_to_bf16_rounding(m):
    if not native_block_fp8(0):
        pytest.skip("this torch has no block-scaled FP8 scaled_mm")
    n, k = 512, 1024
    x = randn(m, k).cuda().bfloat16()
    w = (randn(n, k, seed=1) * 0.05).cuda()
    got = fp8_linear(x, fp8_weight(w)).float()
    xh, wh = fake_quantize_fp8(x.float(), "block128"), fake_quantize_fp8(w, "block128")
    exact = xh.double() @ wh.double().t()
    bound = 2.0**-7 * (xh.abs().double() @ wh.abs().double().t()) + 2.0**-8 * exact.abs()
    assert ((got.double() - exact).abs() <= bound + 1e-30).all()


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_w8a8_layer_uses_the_native_gemm_and_follows_weight_updates():
    from fp4stack.nn.inference_linear import native_fp8_ok
    from fp4stack.nn.linear import QuantLinear

    if not native_block_fp8(0):
        pytest.skip("this torch has no block-scaled FP8 scaled_mm")
    layer = QuantLinear(256, 128, bias=False, recipe="w8a8").cuda().bfloat16()
    layer.requires_grad_(False)
    x = randn(8, 256).cuda().bfloat16()
    assert native_fp8_ok(x, layer)
    first = layer(x)
    assert torch.equal(first, fp8_linear(x, fp8_weight(layer.weight)))
    cached = layer.fp8_weight()
    with torch.no_grad():
        layer.weight.mul_(2.0)  # an in-place update, as a weight sync does
    layer.refresh_inference_cache()
    assert layer.fp8_weight() is cached  # refreshed in place: a captured graph keeps reading it
    assert torch.equal(layer(x), fp8_linear(x, fp8_weight(layer.weight)))
    assert not torch.equal(layer(x), first)
