"""The RoPE kernel (kernels/rope.py) against the torch form it replaces in decoding
(models.rope.apply_rope_reference): the same bits, for strided q/k views, shared and per-row
positions, and odd head sizes; on the CPU under the Triton interpreter in float32 (whose
bfloat16 casts are off), on a GPU in bfloat16 too."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4stack.models import rope as torch_rope

pytest.importorskip("triton")
from fp4stack.kernels import rope  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def case(b, s, h, hd, per_row, strided, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, 2 * h if strided else h, hd, generator=g) * 4
    x = x[:, :, ::2] if strided else x  # a strided view, as q/k split from one projection
    pos = torch.randint(0, 5000, (b, s) if per_row else (s,), generator=g)
    cos, sin = torch_rope.rope_cos_sin(pos, hd, 10000.0)
    return x.to(DEVICE, dtype), cos.to(DEVICE), sin.to(DEVICE)


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 3), s=st.integers(1, 9), h=st.integers(1, 5),
       hd=st.sampled_from([2, 6, 8, 64, 128]), per_row=st.booleans(), strided=st.booleans())
def test_kernel_equals_the_torch_form(b, s, h, hd, per_row, strided):
    x, cos, sin = case(b, s, h, hd, per_row, strided, seed=b * 100 + s * 10 + h)
    got, want = rope.apply_rope(x, cos, sin), torch_rope.apply_rope_reference(x, cos, sin)
    assert got.is_contiguous() and got.dtype == want.dtype
    assert torch.equal(got, want)


@pytest.mark.skipif(not CUDA, reason="bfloat16 casts need the GPU (the interpreter's are off)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_equals_the_torch_form_in_half_precision_on_cuda(dtype):
    for per_row in (False, True):
        x, cos, sin = case(4, 33, 9, 64, per_row, strided=True, dtype=dtype)
        assert torch.equal(rope.apply_rope(x, cos, sin),
                           torch_rope.apply_rope_reference(x, cos, sin))


@pytest.mark.skipif(not CUDA, reason="the dispatch to the kernel is for CUDA tensors")
def test_apply_rope_takes_the_kernel_only_without_autograd(monkeypatch):
    calls = []
    real = rope.apply_rope
    monkeypatch.setattr(rope, "apply_rope", lambda *a: calls.append(1) or real(*a))
    x, cos, sin = case(2, 3, 4, 64, per_row=False, strided=False, dtype=torch.bfloat16)
    with torch.no_grad():
        torch_rope.apply_rope(x, cos, sin)
    torch_rope.apply_rope(x.requires_grad_(), cos, sin).sum().backward()
    assert calls == [1] and x.grad is not None


def test_unsupported_inputs_are_refused_by_name():
    x, cos, sin = case(1, 2, 2, 8, per_row=False, strided=False)
    assert not rope.supported(x.double(), cos)
    assert not rope.supported(x, cos[:1])  # positions for another length
    assert not rope.supported(x, torch.cat([cos[None]] * 3))  # for another batch
    assert rope.supported(x, cos) and rope.supported(x, cos[None])
    with pytest.raises(ValueError, match="rope kernel"):
        rope.apply_rope(x[..., :7], cos[..., :7], sin[..., :7])


def test_cpu_and_autograd_use_the_torch_form():
    x, cos, sin = case(2, 3, 2, 8, per_row=True, strided=True)
    x = x.cpu().requires_grad_()
    out = torch_rope.apply_rope(x, cos.cpu(), sin.cpu())
    assert out.grad_fn is not None  # differentiable: the torch form
    assert torch.equal(out, torch_rope.apply_rope_reference(x, cos.cpu(), sin.cpu()))
