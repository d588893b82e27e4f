"""The Triton backend as the layers and optimizers reach it: through `ops.impl` (the package
`fp4stack.kernels`), on CPU tensors under the interpreter, against the reference backend, bit
for bit. The kernel tests call the kernels' modules directly; these catch a backend function a
caller reaches that the package does not expose, and a dispatch that differs from the
reference's (the order of random draws included)."""

from __future__ import annotations

import pytest
import torch

from fp4stack import kernels, ops
from fp4stack.formats import nvfp4 as reference
from fp4stack.nn.linear import QuantLinear

pytest.importorskip("triton")
# On a GPU the layers reach the kernels with CUDA tensors (the other tests); the patch here makes
# CPU tensors take them, which only the interpreter can run.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors need the "
                                 "Triton interpreter; on a GPU the other tests cover this")


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """A function running `fn` with the reference backend, then with the kernels."""

    def both(fn):
        want = fn()
        monkeypatch.setattr(ops, "backend_for", lambda device: "triton")
        try:
            got = fn()
        finally:
            monkeypatch.undo()
        return got, want

    return both


def test_the_package_exposes_every_backend_function():
    for name in kernels.BACKEND_FUNCTIONS:
        assert callable(getattr(kernels, name)), name
        # the reference has each too, but the pair (ops makes it from two fake_quantize calls)
        assert name == "fake_quantize_pair" or callable(getattr(reference, name)), name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kernels.nope  # noqa: B018


@pytest.mark.parametrize("in_place", [False, True], ids=["copied", "in-place"])
@pytest.mark.parametrize("name", ["nvfp4", "nvfp4-nvidia", "nvfp4-4over6"])
def test_a_quantized_linear_trains_alike_on_both_backends(name, in_place, triton_on_cpu,
                                                          monkeypatch):
    # Both ways of taking the backward's transposed operands: copied to rows, or in place
    # (the column-major tiles and the pair kernel).
    from fp4stack.kernels import nvfp4

    monkeypatch.setattr(nvfp4, "TRANSPOSE_IN_KERNEL", in_place)

    def step():
        torch.manual_seed(0)
        layer = QuantLinear(64, 48, bias=True, recipe=name)
        x = torch.randn(32, 64, requires_grad=True)
        torch.manual_seed(7)  # the stochastic roundings' draws
        y = layer(x)
        y.backward(torch.randn(32, 48))
        return y.detach(), x.grad, layer.weight.grad, layer.bias.grad

    got, want = triton_on_cpu(step)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_muon4_step_is_alike_on_both_backends(triton_on_cpu):
    from fp4stack.optim.muon4 import Muon4

    def step():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(r, c)) for r, c in ((16, 32), (16, 32), (32, 16))]
        opt = Muon4(ps, lr=0.02, cuda_graphs=False)
        for _ in range(2):
            for p in ps:
                p.grad = torch.randn_like(p)
            opt.step()
        return [p.detach().clone() for p in ps]

    got, want = triton_on_cpu(step)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
