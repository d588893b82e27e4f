"""The public API's dispatch between backends, and its argument checks."""

from __future__ import annotations

import pytest
import torch

import fp4stack
from fp4stack import api


def test_cpu_tensors_use_the_reference(monkeypatch):
    monkeypatch.delenv("FP4STACK_BACKEND", raising=False)
    assert api.backend_for(torch.device("cpu")) == "reference"


def test_backend_override(monkeypatch):
    monkeypatch.setenv("FP4STACK_BACKEND", "reference")
    assert api.backend_for(torch.device("cuda")) == "reference"
    monkeypatch.setenv("FP4STACK_BACKEND", "triton")
    with pytest.raises(RuntimeError, match="FP4STACK_BACKEND=triton"):
        api.backend_for(torch.device("cpu"))
    monkeypatch.setenv("FP4STACK_BACKEND", "fast")
    with pytest.raises(ValueError, match="FP4STACK_BACKEND must be one of"):
        fp4stack.quantize(torch.randn(2, 16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_use_triton(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("FP4STACK_BACKEND", raising=False)
    assert api.backend_for(torch.device("cuda")) == "triton"
    x = torch.randn(64, 128)
    got = fp4stack.dequantize(fp4stack.quantize(x.cuda())).cpu()
    assert torch.equal(got, fp4stack.dequantize(fp4stack.quantize(x)))


@pytest.mark.parametrize("fn", [fp4stack.quantize, fp4stack.fake_quantize])
def test_non_tensor_input_is_a_type_error(fn):
    with pytest.raises(TypeError, match="weights: expected a torch.Tensor, got list"):
        fn([1.0, 2.0], name="weights")


def test_dequantize_needs_an_nvfp4_tensor():
    with pytest.raises(TypeError, match="dequantize expects an NVFP4Tensor"):
        fp4stack.dequantize(torch.zeros(4))


def test_columnwise_needs_two_dims():
    with pytest.raises(ValueError, match="columnwise=True needs >= 2 dims"):
        fp4stack.quantize(torch.randn(32), columnwise=True)


def test_fake_quantize_gradient_flows_to_the_input():
    x = torch.randn(4, 32, requires_grad=True)
    fp4stack.fake_quantize(x, rounding="stochastic", seed=0).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("spec", [fp4stack.QuantSpec(), fp4stack.QuantSpec(hadamard=True),
                                  fp4stack.QuantSpec.fp8(),
                                  fp4stack.QuantSpec(format="none")])
def test_fake_quantize_into_another_dtype_is_the_cast_result(spec):
    # dtype= is one rounding of the result, and the straight-through gradient comes back in
    # the input's dtype (float32 master weights quantized for a bf16 GEMM).
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 64, generator=g) * 3).requires_grad_()
    y = fp4stack.fake_quantize(x, spec=spec, dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, fp4stack.fake_quantize(x.detach(), spec=spec).to(torch.bfloat16))
    dy = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    y.backward(dy)
    want = x.detach().clone().requires_grad_()
    fp4stack.fake_quantize(want, spec=spec).to(torch.bfloat16).backward(dy)
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, want.grad)


def test_spec_and_individual_options_do_not_mix():
    spec = fp4stack.QuantSpec(block=(16, 16))
    x = torch.randn(16, 32)
    # Options left at their defaults (a block given as a list too) are not a conflict.
    same = fp4stack.fake_quantize(x, spec=spec, block=[1, 16], rounding="rne")
    assert torch.equal(same, fp4stack.fake_quantize(x, spec=spec))
    with pytest.raises(ValueError, match="got spec= and rounding='stochastic'"):
        fp4stack.fake_quantize(x, spec=spec, rounding="stochastic")
    with pytest.raises(ValueError, match="got spec= and hadamard=True"):
        fp4stack.quantize(x, spec=spec, hadamard=True)


def test_fake_quantize_records_a_graph_only_when_a_gradient_is_wanted():
    x = torch.randn(4, 32)
    plain = fp4stack.fake_quantize(x)
    assert plain.grad_fn is None
    w = x.clone().requires_grad_()
    with torch.no_grad():
        assert fp4stack.fake_quantize(w).grad_fn is None
    tracked = fp4stack.fake_quantize(w)
    assert tracked.grad_fn is not None and torch.equal(tracked.detach(), plain)
