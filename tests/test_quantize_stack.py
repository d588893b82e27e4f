"""quantize_stack / fake_quantize_stack (a stack of expert weights, each matrix quantized with
its own global amax): the kernels' few launches for the stack against the reference's loop of
quantize, bit for bit, packed and fake, in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from fp4stack import api
from fp4stack.formats import nvfp4 as reference
from fp4stack.formats.spec import QuantSpec

pytest.importorskip("triton")

from fp4stack.kernels import nvfp4 as kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
P = dict(nan_policy="propagate")
SPECS = {"rne": QuantSpec(**P), "16x16": QuantSpec(block=(16, 16), **P),
         "rht": QuantSpec(hadamard=True, **P), "4over6": QuantSpec(four_over_six=True, **P),
         "raise": QuantSpec()}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float8_e4m3fn or a.dtype == torch.uint8:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    nan = torch.isnan(a) & torch.isnan(b)
    return bool(((a.view(ints) == b.view(ints)) | nan).all())


def stack(b: int, m: int, k: int, nan: bool, seed: int = 0) -> torch.Tensor:
    """Matrices over nine decades: one all zero, one tiny (a capped encode scale), and with
    `nan` one holding a NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, m, k, generator=g) * torch.logspace(-6, 3, b)[:, None, None]
    x[0] = 0.0
    x[1] *= 1e-38
    if nan:
        x[2, 1, 3] = float("nan")
    return x


@pytest.mark.parametrize("name", [n for n in SPECS if n != "raise"])
@pytest.mark.parametrize("small", [True, False], ids=["one-program-amax", "grid-amax"])
def test_kernel_stack_matches_the_reference_loop(name, small, monkeypatch):
    if not small:  # several programs a matrix
        monkeypatch.setattr(kernels, "SMALL_AMAX", 0)
    monkeypatch.setattr(kernels, "TRANSPOSE_IN_KERNEL", True)
    spec = SPECS[name]
    x = stack(5, 32, 48, nan=True) if small else stack(3, 64, 96, nan=True)
    for view in (x, x.mT):  # a transposed view, as a column-major operand comes
        got = kernels.quantize_stack(view.to(DEVICE), spec)
        want = reference.quantize_stack(view, spec)
        assert len(got) == len(want) == x.shape[0]
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and same(g.data, w.data) and same(g.scales, w.scales)
            assert same(g.amax, w.amax)
        for dtype in (torch.float32, torch.bfloat16):
            fake = kernels.fake_quantize_stack(view.to(DEVICE), spec, dtype=dtype)
            assert same(fake, reference.fake_quantize_stack(view, spec, dtype=dtype))


@pytest.mark.parametrize("shape", [(4, 16, 40), (2, 3, 17, 32), (1, 1, 16)])
def test_the_stack_is_each_matrix_quantized_alone(shape):
    # Leading dims flattened, K padded to whole blocks: every matrix as quantize sees it alone.
    spec = SPECS["rne"]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 10
    mats = x.reshape(-1, *shape[-2:])
    want = torch.stack([reference.fake_quantize(m, spec) for m in mats]).reshape(shape)
    assert same(reference.fake_quantize_stack(x, spec), want)
    assert same(api.fake_quantize_stack(x.to(DEVICE), spec), want)  # the device's backend
    got = kernels.quantize_stack(x.to(DEVICE), spec)
    for g, m in zip(got, mats, strict=True):
        assert same(kernels.dequantize(g), reference.fake_quantize(m, spec))


def test_a_non_finite_matrix_raises_under_the_raise_policy_and_an_empty_stack_is_empty():
    x = stack(3, 16, 32, nan=True)
    for impl, t in ((kernels, x.to(DEVICE)), (reference, x)):
        with pytest.raises(ValueError, match="NaN|Inf|non-finite"):
            impl.fake_quantize_stack(t, SPECS["raise"])
        empty = impl.fake_quantize_stack(t[:0], SPECS["raise"], dtype=torch.bfloat16)
        assert empty.shape == (0, 16, 32) and empty.dtype == torch.bfloat16
        assert impl.quantize_stack(t[:0], SPECS["raise"]) == []


def test_stacks_refuse_row_scales_stochastic_rounding_and_vectors():
    for spec in (QuantSpec(global_scale="row", **P), QuantSpec(rounding="stochastic", **P)):
        for impl, t in ((kernels, torch.randn(2, 16, 16).to(DEVICE)),
                        (reference, torch.randn(2, 16, 16))):
            with pytest.raises(ValueError, match="per-tensor, round-to-nearest"):
                impl.quantize_stack(t, spec)
    with pytest.raises(ValueError, match="takes matrices"):
        kernels.quantize_stack(torch.randn(32).to(DEVICE), SPECS["rne"])


def test_a_stack_decoded_row_by_row_with_its_matrices_amaxes_is_each_matrix_decoded():
    # What the refit's self-check does for a packed stack (rl.sync._stack_checksums): one
    # row-scaled dequantization of all experts, each row with its matrix's amax.
    from dataclasses import replace

    from fp4stack.formats.tensor import NVFP4Tensor

    spec = SPECS["rne"]
    x = stack(4, 16, 40, nan=False)
    for impl, t in ((kernels, x.to(DEVICE)), (reference, x)):
        mats = impl.quantize_stack(t, spec)
        e, (m, k) = len(mats), mats[0].shape
        rows = NVFP4Tensor(torch.stack([q.data for q in mats]).reshape(e * m, -1),
                           torch.stack([q.scales for q in mats]).reshape(e * m, -1),
                           torch.stack([q.amax for q in mats]).repeat_interleave(m)[:, None],
                           (e * m, k), replace(spec, global_scale="row"))
        want = torch.stack([impl.dequantize(q) for q in mats])
        assert same(impl.dequantize(rows).reshape(e, m, k), want)
