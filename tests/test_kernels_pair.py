"""The pair kernel (a linear's forward operand and its backward's column-wise one from one read
of x) against two calls of the torch reference, bit for bit, draws of the random stream
included. On CPU under the Triton interpreter; on a GPU compiled, plus a large case."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from fp4stack.formats import nvfp4 as reference
from fp4stack.formats.spec import QuantSpec

pytest.importorskip("triton")

from fp4stack.kernels import nvfp4 as kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
P = dict(nan_policy="propagate")
RNE, SR = QuantSpec(**P), QuantSpec(rounding="stochastic", **P)
RHT, RHT_SR = QuantSpec(hadamard=True, **P), QuantSpec(hadamard=True, rounding="stochastic", **P)
FOS = QuantSpec(four_over_six=True, **P)
PAIRS = {  # (row spec, column spec): the recipes' (x, x_wgrad) and (dy, dy_wgrad) pairs
    "nvfp4": (RNE, RNE), "nvidia-x": (RNE, RHT), "nvidia-dy": (SR, RHT_SR),
    "4over6": (FOS, FOS), "rht-both": (RHT, RHT_SR),
}


@pytest.fixture(autouse=True)
def in_place(monkeypatch):
    # The pair kernel only runs where transposed operands are read in place.
    monkeypatch.setattr(kernels, "TRANSPOSE_IN_KERNEL", True)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    view = {4: torch.int32, 2: torch.int16}[a.element_size()]
    both_nan = torch.isnan(a) & torch.isnan(b)
    return a.shape == b.shape and bool(((a.view(view) == b.view(view)) | both_nan).all())


def separate(x, spec, spec_t, cols_t, **kw):
    """What the two calls give: the reference on x and on xᵀ zero-padded to cols_t columns."""
    xt = F.pad(x.t(), (0, cols_t - x.shape[0]))
    row = reference.fake_quantize(x, spec, amax=kw.get("amax"), seed=kw.get("seed"),
                                  dtype=kw.get("dtype"))
    col = reference.fake_quantize(xt, spec_t, amax=kw.get("amax_t"), seed=kw.get("seed_t"),
                                  dtype=kw.get("dtype"))
    return row, col


def operand(rows: int, cols: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-4, 2, rows)[:, None]
    return x.to(dtype)


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("shape", [(40, 72), (64, 48), (33, 160)])
def test_pair_matches_two_reference_calls(pair, shape):
    spec, spec_t = PAIRS[pair]
    x = operand(*shape, seed=shape[1])
    m = shape[0]
    cols_t = m + (-m % 16) if spec_t.hadamard or m % 2 else m
    if spec.hadamard and shape[1] % 16:  # refused alike: the transform needs whole blocks
        with pytest.raises(ValueError, match="multiple of 16"):
            separate(x, spec, spec_t, cols_t)
        with pytest.raises(ValueError, match="multiple of 16"):
            kernels.fake_quantize_pair(x.to(DEVICE), spec, spec_t, cols_t=cols_t)
        return
    got = kernels.fake_quantize_pair(x.to(DEVICE), spec, spec_t, seed=3, seed_t=4, cols_t=cols_t)
    want = separate(x, spec, spec_t, cols_t, seed=3, seed_t=4)
    assert same_values(got[0], want[0]) and same_values(got[1], want[1])


@pytest.mark.parametrize("pair", list(PAIRS))
def test_pair_of_a_large_operand_takes_both_amaxes_from_one_read(pair, monkeypatch):
    # Above SMALL_AMAX elements (lowered here) the two amaxes come from one pass over x when
    # they differ (a transform on either side): several programs, partial tiles, a NaN row.
    monkeypatch.setattr(kernels, "SMALL_AMAX", 0)
    spec, spec_t = PAIRS[pair]
    x = operand(72, 160, seed=4)
    for nan in (False, True):
        if nan:
            x[70, 3] = float("nan")
        got = kernels.fake_quantize_pair(x.to(DEVICE), spec, spec_t, seed=3, seed_t=4,
                                         cols_t=80)
        want = separate(x, spec, spec_t, 80, seed=3, seed_t=4)
        assert same_values(got[0], want[0]) and same_values(got[1], want[1])


@pytest.mark.parametrize("pair", ["nvidia-dy", "nvfp4"])
def test_pair_draws_the_seeds_of_the_two_calls_in_their_order(pair):
    spec, spec_t = PAIRS[pair]
    x = operand(48, 64, dtype=torch.bfloat16)
    torch.manual_seed(7)
    got = kernels.fake_quantize_pair(x.to(DEVICE), spec, spec_t, cols_t=48)
    after = torch.randint(1 << 30, ())
    torch.manual_seed(7)
    want = separate(x, spec, spec_t, 48)
    assert same_values(got[0], want[0]) and same_values(got[1], want[1])
    assert torch.equal(after, torch.randint(1 << 30, ()))  # as many draws as the two calls


@pytest.mark.parametrize("pair", ["nvidia-x", "4over6"])
def test_pair_imposed_amaxes_bf16_output_and_nan(pair):
    spec, spec_t = PAIRS[pair]
    x = operand(32, 80, seed=5)
    x[3, 17] = float("nan")
    kw = dict(amax=torch.tensor(7.5), amax_t=torch.tensor(30.0), dtype=torch.bfloat16)
    got = kernels.fake_quantize_pair(x.to(DEVICE), spec, spec_t, seed=1, seed_t=2, cols_t=32,
                                     **{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
                                        for k, v in kw.items()})
    want = separate(x, spec, spec_t, 32, seed=1, seed_t=2, **kw)
    assert got[0].dtype == torch.bfloat16 and torch.isnan(got[0]).any()
    assert same_values(got[0], want[0]) and same_values(got[1], want[1])


def test_pair_of_strided_input_and_fallbacks():
    x = operand(48, 96, seed=2)
    view = x.t()[::2]  # [48, 48], neither dim contiguous
    got = kernels.fake_quantize_pair(x.to(DEVICE).t()[::2], *PAIRS["nvidia-dy"], seed=1,
                                     seed_t=2, cols_t=48)
    want = separate(view, *PAIRS["nvidia-dy"], 48, seed=1, seed_t=2)
    assert same_values(got[0], want[0]) and same_values(got[1], want[1])
    # Specs the kernel does not take (16x16 tiles, a NaN check, row scales) make two calls.
    for spec in (QuantSpec(block=(16, 16), **P), QuantSpec(), QuantSpec(global_scale="row", **P)):
        assert kernels.pair_fusable(x, RNE, RNE) and not kernels.pair_fusable(x, spec, RNE)
        got = kernels.fake_quantize_pair(x.to(DEVICE), spec, RNE, cols_t=48)
        want = separate(x, spec, RNE, 48)
        assert same_values(got[0], want[0]) and same_values(got[1], want[1])


def test_pair_refuses_a_padding_beyond_one_block():
    with pytest.raises(ValueError, match="cols_t in \\[40, 48\\].*cols_t=64"):
        kernels.fake_quantize_pair(operand(40, 32).to(DEVICE), RNE, RNE, cols_t=64)
    with pytest.raises(ValueError, match="column-wise.*multiple of 16, got 40"):
        kernels.fake_quantize_pair(operand(40, 32).to(DEVICE), RNE, RHT, cols_t=40)


@pytest.mark.skipif(DEVICE == "cpu", reason="needs a CUDA device")
@pytest.mark.parametrize("pair", list(PAIRS))
def test_pair_large_bf16_on_gpu(pair):
    spec, spec_t = PAIRS[pair]
    x = operand(4096, 1536, dtype=torch.bfloat16, seed=9)
    got = kernels.fake_quantize_pair(x.cuda(), spec, spec_t, seed=5, seed_t=6, cols_t=4096)
    want = separate(x.cuda(), replace(spec), spec_t, 4096, seed=5, seed_t=6)
    assert same_values(got[0], want[0]) and same_values(got[1], want[1])


def test_api_pair_names_what_is_wrong():
    from fp4stack.api import fake_quantize_pair

    with pytest.raises(ValueError, match="acts: a pair takes a matrix"):
        fake_quantize_pair(torch.randn(2, 16, 32), RNE, RNE, name="acts")
    with pytest.raises(ValueError, match="acts \\(column-wise\\): quantize produces NVFP4"):
        fake_quantize_pair(torch.randn(16, 32), RNE, QuantSpec.fp8("row"), name="acts")
    with pytest.raises(TypeError, match="seed must be an int"):
        fake_quantize_pair(torch.randn(16, 32), SR, SR, seed_t=1.5)


def test_pair_without_in_place_transposes_makes_two_calls(monkeypatch):
    monkeypatch.setattr(kernels, "TRANSPOSE_IN_KERNEL", False)
    x = operand(48, 96, seed=3)
    assert not kernels.pair_fusable(x, RNE, RHT)
    got = kernels.fake_quantize_pair(x.to(DEVICE), *PAIRS["nvidia-dy"], seed=1, seed_t=2,
                                     cols_t=48)
    want = separate(x, *PAIRS["nvidia-dy"], 48, seed=1, seed_t=2)
    assert same_values(got[0], want[0]) and same_values(got[1], want[1])
