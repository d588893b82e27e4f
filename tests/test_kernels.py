"""Triton kernels vs the torch reference, bit for bit (data bytes, scale bytes, amax, values).

On CPU the kernels run under the Triton interpreter on small float32 inputs; on a GPU the same
tests run compiled, plus large and adversarial cases (marked gpu).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fp4stack.formats import nvfp4 as reference
from fp4stack.formats.hadamard import rht
from fp4stack.formats.spec import QuantSpec

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from fp4stack.kernels import nvfp4 as kernels  # noqa: E402
from fp4stack.kernels import nvfp4_jit as jit  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

SPECS = {
    "rne": QuantSpec(),
    "2d": QuantSpec(block=(16, 16)),
    "sr": QuantSpec(rounding="stochastic"),
    "rht": QuantSpec(hadamard=True),
    "rht-sr": QuantSpec(hadamard=True, rounding="stochastic"),
    "4over6": QuantSpec(four_over_six=True),
    "2d-sr-4over6": QuantSpec(block=(16, 16), rounding="stochastic", four_over_six=True),
    "row": QuantSpec(global_scale="row"),
    "row-rht-sr-4over6": QuantSpec(global_scale="row", hadamard=True, rounding="stochastic",
                                   four_over_six=True),
}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, except that any NaN equals any NaN (payloads carry no meaning)."""
    a, b = a.cpu(), b.cpu()
    both_nan = torch.isnan(a) & torch.isnan(b)
    return bool(((bits(a) == bits(b)) | both_nan).all()) and a.shape == b.shape


def assert_same_quantized(got, want):
    assert got.shape == want.shape and got.spec == want.spec
    assert same_values(got.amax, want.amax), (got.amax, want.amax)
    bad_scales = (bits(got.scales) != bits(want.scales)).sum().item()
    bad_data = (bits(got.data) != bits(want.data)).sum().item()
    assert bad_scales == 0 and bad_data == 0, f"{bad_scales} scale bytes, {bad_data} data bytes"


def check_all_paths(x: torch.Tensor, spec: QuantSpec, **kw):
    """quantize, fake_quantize and dequantize of the kernels equal the reference (on CPU)."""
    want = reference.quantize(x.cpu(), spec, **kw)
    got = kernels.quantize(x, spec, **kw)
    assert_same_quantized(got, want)
    assert same_values(kernels.dequantize(want.to(x.device)), reference.dequantize(want))
    fake_want = reference.dequantize(want, x.dtype)
    assert same_values(kernels.fake_quantize(x, spec, **kw), fake_want)


def wide_range(rows: int, cols: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    # Rows spanning 1e-6..1e3 reach subnormal E4M3 block scales.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 3, rows)[:, None]
    return x.to(dtype)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("shape", [(40, 64), (3, 17, 48)])
def test_kernels_match_reference(name, shape):
    spec = SPECS[name]
    x = wide_range(int(torch.tensor(shape[:-1]).prod()), shape[-1], seed=len(name))
    check_all_paths(x.reshape(shape).to(DEVICE), spec, seed=11)


@pytest.mark.parametrize("name", ["rne", "2d", "sr", "4over6"])
def test_k_not_multiple_of_16_and_given_amax(name):
    x = wide_range(20, 37, seed=3).to(DEVICE)
    check_all_paths(x, SPECS[name], seed=5)
    check_all_paths(x, SPECS[name], seed=5, amax=float(x.abs().max()) * 3)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                    (torch.bfloat16, torch.float32)])
def test_fake_quantize_into_another_dtype(name, dtypes):
    # One rounding of the float32 values to the output dtype, the reference's cast; from a
    # float32 input that is the same as fake-quantizing in float32 and casting after.
    x_dtype, out_dtype = dtypes
    x = wide_range(24, 48, x_dtype, seed=len(name)).to(DEVICE)
    want = reference.fake_quantize(x.cpu(), SPECS[name], seed=3, dtype=out_dtype)
    got = kernels.fake_quantize(x, SPECS[name], seed=3, dtype=out_dtype)
    assert got.dtype == out_dtype and same_values(got, want)
    if x_dtype == torch.float32:
        assert same_values(want, reference.fake_quantize(x.cpu(), SPECS[name], seed=3)
                           .to(out_dtype))
    q = reference.quantize(x.cpu(), SPECS[name], seed=3)
    assert same_values(kernels.dequantize(q.to(x.device), out_dtype),
                       reference.dequantize(q, out_dtype))


def test_tie_points_exact():
    # amax = 2688 makes S_enc = 1, and a power-of-two block scale s gives exact x / s, so every
    # element lands exactly on an E2M1 rounding tie (or one float32 ulp beside it).
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    near = torch.cat([ties, torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1)])
    vals = torch.cat([torch.tensor([6.0]), near, -near, torch.zeros(1)])  # 23 + 22 + 1 = 46
    vals = torch.nn.functional.pad(vals, (0, 48 - vals.numel()))
    scales = 2.0 ** torch.arange(-8, 6, dtype=torch.float32)
    x = (vals[None, :] * scales[:, None]).to(DEVICE)
    check_all_paths(x, SPECS["rne"], amax=2688.0)
    check_all_paths(x, SPECS["4over6"], amax=1536.0)


def test_stochastic_rounding_on_and_beside_the_grid():
    """SR of values on every E2M1 grid point, one ulp either side of each (the binade edges 2
    and 4 among them) and beyond 6 (given a small amax, so blocks saturate): kernel and
    reference agree bit for bit, draws included."""
    grid = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    vals = torch.cat([grid, torch.nextafter(grid, grid + 1), torch.nextafter(grid, grid - 1),
                      torch.tensor([0.25, 2.5, 5.0, 5.999])])  # 25 values
    vals = torch.cat([vals, -vals])
    vals = torch.nn.functional.pad(vals, (0, 64 - vals.numel()))
    scales = 2.0 ** torch.arange(-8, 6, dtype=torch.float32)
    x = (vals[None, :] * scales[:, None]).to(DEVICE)
    for seed in (1, 2, 3):
        check_all_paths(x, SPECS["sr"], amax=2688.0, seed=seed)
        check_all_paths(x, SPECS["sr"], amax=float(x.abs().max()) / 4, seed=seed)


@pytest.mark.parametrize(
    "x",
    [
        torch.zeros(16, 32),
        torch.full((16, 32), torch.finfo(torch.float32).max),
        torch.full((16, 32), -torch.finfo(torch.float32).max),
        torch.full((16, 32), torch.finfo(torch.float32).tiny / 8),  # float32 subnormals
        torch.randn(16, 32, generator=torch.Generator().manual_seed(0)) * 1e-36,  # S_enc capped
        torch.cat([torch.randn(15, 32), torch.full((1, 32), 1e4)]),
    ],
    ids=["zeros", "max", "-max", "fp32-subnormal", "capped-scale", "outlier"],
)
@pytest.mark.parametrize("name", ["rne", "2d", "4over6", "sr", "row"])
def test_adversarial(x, name):
    check_all_paths(x.to(DEVICE), SPECS[name], seed=1)


def test_nan_propagate_and_raise():
    x = torch.randn(16, 32)
    x[3, 5] = float("nan")
    x[7, 9] = float("inf")
    spec = QuantSpec(nan_policy="propagate")
    check_all_paths(x.to(DEVICE), spec)
    check_all_paths(x.to(DEVICE), spec, amax=10.0)
    for amax in (None, 10.0):
        with pytest.raises(ValueError, match="weights: 2 of 512 values are NaN or Inf"):
            kernels.quantize(x.to(DEVICE), QuantSpec(), amax=amax, name="weights")


@pytest.mark.parametrize("name", ["rht", "rht-sr"])
def test_hadamard_overflow_of_finite_values(name):
    # Values near float32's max are finite, but the transform's sums overflow: an error naming
    # the tensor by default (not the "NaN or Inf" one, which would blame the input); with
    # nan_policy="propagate" the overflowing blocks are NaN in the kernels as in the reference.
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    x[2, :16] = torch.finfo(torch.float32).max * torch.sign(x[2, :16]).abs()
    x[5, 16:] = -3e38
    for amax in (None, 1e38):
        for quant in (reference.quantize, kernels.quantize):
            with pytest.raises(ValueError, match="acts: its 16-point Hadamard transform overflows"):
                quant(x.to(DEVICE), SPECS[name], amax=amax, seed=1, name="acts")
    spec = replace(SPECS[name], nan_policy="propagate")
    check_all_paths(x.to(DEVICE), spec, amax=1e38, seed=1)
    y = reference.dequantize(reference.quantize(x, spec, amax=1e38, seed=1))
    nan_blocks = torch.isnan(y).reshape(8, 2, 16).all(-1)
    assert nan_blocks[2, 0] and nan_blocks[5, 1] and nan_blocks.sum() == 2


@triton.jit
def _cast_rne_kernel(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, jit.cast_rne(tl.load(x_ptr + i), out_ptr))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cast_rne_is_torchs_cast(dtype):
    # Ties to even in both directions, a carry into the exponent, the largest finite values
    # (bfloat16 rounds FLT_MAX to inf), subnormals of both formats, signed zeros, inf and NaN,
    # then random values over float32's whole range.
    one = 1.0 + torch.tensor([2**-8, 3 * 2**-8, 2**-9, 3 * 2**-9, 2**-9 + 2**-20, 2**-7 - 2**-20])
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-40, 9.2e-41, 6e-8, 3e-5, 65504.0, 65520.0,
                            3.3895e38, 3.4028234e38, float("inf"), float("-inf"), float("nan")])
    g = torch.Generator().manual_seed(1)
    rand = torch.randn(4096, generator=g) * torch.logspace(-44, 38, 4096)
    x = torch.cat([one, -one, special, torch.nextafter(2 - one, one), rand])
    x = torch.nn.functional.pad(x, (0, 8192 - x.numel()))
    out = torch.empty(8192, dtype=dtype, device=DEVICE)
    _cast_rne_kernel[(1,)](x.to(DEVICE), out, N=8192)
    assert same_values(out, x.to(dtype))


@triton.jit
def _abs_max_of_rows(x_ptr, out_ptr, C: tl.constexpr):
    row = tl.program_id(0)
    x = tl.load(x_ptr + row * C + tl.arange(0, C))
    tl.store(out_ptr + row, jit.abs_max(x, 0))


def test_abs_max_is_amax_of_abs_with_nan():
    # Every amax of the kernels: signed zeros, infinities, subnormals, and NaNs of either sign
    # (a NaN's sign bit set reads as a negative int32, so the sign must be cleared first).
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-40, 3.0, -448.0, 3.4e38, -3.4e38,
                            float("inf"), float("-inf"), float("nan"), -float("nan")])
    rows = [special[[0, 1]], special[[1, 2, 3]], special[[4, 5, 6, 7]], special[[7, 9]],
            special[[8, 9, 10]], special[[4, 11]], special[[11, 0]], torch.randn(16)]
    x = torch.zeros(len(rows), 16)
    for i, r in enumerate(rows):
        x[i, : len(r)] = r
    assert torch.signbit(x[5, 1]) and torch.isnan(x[5, 1])  # a NaN with its sign bit set
    out = torch.empty(len(rows), device=DEVICE)
    _abs_max_of_rows[(len(rows),)](x.to(DEVICE), out, C=16)
    assert same_values(out, x.abs().amax(dim=1))


@pytest.mark.parametrize("spec", [QuantSpec(), QuantSpec(hadamard=True),
                                  QuantSpec(global_scale="row"), QuantSpec(block=(16, 16))])
def test_amax_on_both_sides_of_the_one_program_size(spec):
    # Up to SMALL_AMAX elements one program takes the whole amax (no host-side reduction):
    # the same values as the grid above it and the reference, NaN rows included.
    for rows, k in ((1, 80), (3, 70), (32, 1000), (16, kernels.SMALL_AMAX // 16 + 16)):
        x = wide_range(rows, k, seed=rows).to(DEVICE)
        x[-1, 3] = float("nan")
        if (spec.is_2d and rows % 16) or (spec.hadamard and k % 16):
            continue
        x3 = kernels._as_3d(x, spec)
        got = kernels._amax(x3, spec)
        if spec.row_scaled:
            want = reference.row_amax(x.float()).reshape(-1)
        else:
            want = (rht(x.float()) if spec.hadamard else x).abs().amax()
        assert same_values(got.reshape(-1), want.reshape(-1).float()), (rows, k)


def small_operand(name: str) -> torch.Tensor:
    return wide_range(2 * 16, 32, seed=len(name)).reshape(2, 16, 32).to(DEVICE)


def amax_inside(monkeypatch, here: bool) -> None:
    for name in ("AMAX_HERE_READS", "INTERPRETED_AMAX_HERE_READS"):
        monkeypatch.setattr(kernels, name, 1 << 40 if here else 0)
    assert kernels.amax_here(1024, 4) is here


def test_amax_inside_only_where_each_program_reads_little(monkeypatch):
    # Compiled kernels: one decoding row (4096 elements, 8 programs) computes its amax inside;
    # 16 rows (65,536 elements read whole by 32 programs: 28 us slower on the H200) do not.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert kernels.amax_here(4096, 8)
    assert not kernels.amax_here(16 * 4096, 32)
    assert not kernels.amax_here(kernels.AMAX_HERE_ELEMENTS + 16, 1)


@pytest.mark.parametrize("name", list(SPECS))
def test_amax_inside_the_quantize_kernel(name, monkeypatch):
    """A small operand's amax computed by the quantize kernel's own programs (one launch): the
    reference's bits for every spec, 3-D inputs (16x16 blocks per matrix) included."""
    amax_inside(monkeypatch, True)
    check_all_paths(small_operand(name), SPECS[name], seed=11)


@pytest.mark.parametrize("here", [True, False], ids=["amax-in-quantize", "amax-launch-first"])
@pytest.mark.parametrize("name", ["rne", "2d", "row"])
def test_amax_inside_or_before_with_nan(name, here, monkeypatch):
    """Both ways of a small operand's amax (inside the quantize kernel, or the amax kernel's
    launch first): the reference's bits, a NaN propagated as the reference propagates it, and
    refused under the default policy."""
    amax_inside(monkeypatch, here)
    x = small_operand(name)
    check_all_paths(x, SPECS[name], seed=11)
    x[1, 7, 3] = float("nan")
    check_all_paths(x, replace(SPECS[name], nan_policy="propagate"), seed=11)
    with pytest.raises(ValueError, match="acts: 1 of 1024 values are NaN or Inf"):
        kernels.quantize(x, SPECS[name], seed=11, name="acts")


def test_non_contiguous_input():
    x = wide_range(48, 32, seed=9).to(DEVICE)
    check_all_paths(x.t(), SPECS["rne"])
    check_all_paths(x[:, ::2], SPECS["2d"])


@pytest.mark.parametrize("name", list(SPECS))
def test_column_major_input(name, monkeypatch):
    # A transposed view (the backward's column-wise operands) read as it is by the column-major
    # tile (TRANSPOSE_IN_KERNEL; by default it is copied to rows, which the row-major tests
    # cover), with partial tiles on both sides and a NaN; its amax by the grid kernel's
    # column-major tile too (the one-program size lowered to reach it).
    monkeypatch.setattr(kernels, "SMALL_AMAX", 0)
    monkeypatch.setattr(kernels, "TRANSPOSE_IN_KERNEL", True)
    x = wide_range(48, 144, seed=len(name)).to(DEVICE)
    xt = x.t()  # [144, 48], rows contiguous
    assert kernels.column_major(kernels._as_3d(xt, SPECS[name]))
    check_all_paths(xt, SPECS[name], seed=5)
    x[7, 100] = float("nan")
    check_all_paths(xt, replace(SPECS[name], nan_policy="propagate"), seed=5)


def test_seed_is_the_only_randomness():
    x = torch.randn(16, 64).to(DEVICE)
    a = kernels.quantize(x, SPECS["sr"], seed=7)
    b = kernels.quantize(x, SPECS["sr"], seed=7)
    c = kernels.quantize(x, SPECS["sr"], seed=8)
    assert torch.equal(a.data, b.data) and not torch.equal(a.data, c.data)


# ---- compiled kernels on the GPU: large and adversarial inputs ------------------------------


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(SPECS))
def test_gpu_large_random(name, dtype):
    x = wide_range(2048, 4096, dtype, seed=1).cuda()
    check_all_paths(x, SPECS[name], seed=123)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_8192_squared_rne(dtype):
    x = (torch.randn(8192, 8192, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    check_all_paths(x.cuda(), SPECS["rne"])
    check_all_paths(x.cuda(), SPECS["rne"], amax=100.0)


@gpu
def test_gpu_bf16_every_value():
    # Every finite bf16 bit pattern, in blocks of neighbours and with a shared amax.
    allbits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = allbits[torch.isfinite(allbits)].float()
    x = x[: x.numel() // 64 * 64].reshape(-1, 64).to(torch.bfloat16).cuda()
    for name in ("rne", "sr", "4over6"):
        check_all_paths(x, SPECS[name], seed=3)
        check_all_paths(x, SPECS[name], seed=3, amax=float(torch.finfo(torch.bfloat16).max))


@gpu
def test_gpu_stochastic_rounding_statistics():
    # Unbiased: the mean of many draws converges to x much closer than RNE gets.
    x = torch.randn(64, 256, device="cuda")
    amax = float(x.abs().max())
    draws = torch.stack([
        kernels.fake_quantize(x, SPECS["sr"], seed=s, amax=amax) for s in range(512)
    ])
    rne = kernels.fake_quantize(x, SPECS["rne"], amax=amax)
    bias = (draws.mean(0) - x).norm() / x.norm()
    assert bias < 0.25 * ((rne - x).norm() / x.norm())
