"""quantize_units (a stack of matrices, each quantized with its own global amax, as units):
the kernels' three launches against the reference's loop, bit for bit, and the reference
against quantize itself (units times the decode scale are fake_quantize's values)."""

from __future__ import annotations

import pytest
import torch

from fp4stack.formats import nvfp4 as reference
from fp4stack.formats.global_scale import global_decode_scale
from fp4stack.formats.spec import QuantSpec

pytest.importorskip("triton")

from fp4stack.kernels import nvfp4 as kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
P = dict(nan_policy="propagate")
SPECS = {"rne": QuantSpec(**P), "16x16": QuantSpec(block=(16, 16), **P),
         "rht": QuantSpec(hadamard=True, **P), "4over6": QuantSpec(four_over_six=True, **P)}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    nan = torch.isnan(a) & torch.isnan(b)
    return a.shape == b.shape and bool(((a.view(torch.int32) == b.view(torch.int32)) | nan).all())


def stack(b: int, m: int, k: int, seed: int = 0) -> torch.Tensor:
    """Matrices of very different sizes: one all zero, one tiny (a capped encode scale), one
    with a NaN, the rest spread over nine decades."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, m, k, generator=g) * torch.logspace(-6, 3, b)[:, None, None]
    x[0] = 0.0
    if b > 2:
        x[1] *= 1e-38
        x[2, 1, 3] = float("nan")
    return x


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("small", [True, False], ids=["one-program-amax", "grid-amax"])
def test_kernel_stack_matches_reference(name, small, monkeypatch):
    if not small:  # several programs a matrix, both ways round
        monkeypatch.setattr(kernels, "SMALL_AMAX", 0)
    # The transposed view read in place (by default it is copied to rows: the first view's case)
    monkeypatch.setattr(kernels, "TRANSPOSE_IN_KERNEL", True)
    x = stack(5, 32, 48) if small else stack(3, 160, 96)
    for view in (x, x.mT):  # a right operand is quantized through its transpose: column-major
        got = kernels.quantize_units(view.to(DEVICE), SPECS[name])
        want = reference.quantize_units(view, SPECS[name])
        assert same(got[0], want[0]) and same(got[1], want[1])
    one = kernels.quantize_units(x[-1].to(DEVICE), SPECS[name])  # a matrix: 0-d amax
    want = reference.quantize_units(x[-1], SPECS[name])
    assert one[1].shape == () and same(one[0], want[0]) and same(one[1], want[1])


@pytest.mark.parametrize("name", list(SPECS))
def test_reference_units_times_decode_scale_are_fake_quantize(name):
    spec = SPECS[name]
    x = stack(4, 16, 32, seed=1)
    units, amax = reference.quantize_units(x, spec)
    for i in range(4):
        want = reference.fake_quantize(x[i], spec)
        assert same(units[i] * global_decode_scale(amax[i], spec.scale_max), want)
        assert same(amax[i], reference.quantize(x[i], spec).amax)


def test_units_refuse_row_scales_and_stochastic_rounding():
    for spec in (QuantSpec(global_scale="row", **P), QuantSpec(rounding="stochastic", **P)):
        with pytest.raises(ValueError, match="per-tensor, round-to-nearest"):
            kernels.quantize_units(torch.randn(2, 16, 16).to(DEVICE), spec)
        with pytest.raises(ValueError, match="per-tensor, round-to-nearest"):
            reference.quantize_units(torch.randn(2, 16, 16), spec)
