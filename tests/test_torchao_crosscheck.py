"""Cross-check against torchao 0.18's NVFP4 (torchao.prototype.mx_formats.nvfp4_tensor).

We call `NVFP4Tensor.to_nvfp4(x, per_tensor_scale=amax / 2688)` (two-level scaling, the TE recipe)
and compare its packed data (`qdata`, uint8) and block scales (`scale`, float8_e4m3fn, unswizzled).

Conventions: the same. torchao packs the even-index element in the low nibble
(`pack_uint4`: `x[::2] | x[1::2] << 4`) and uses the same sign-bit-3 E2M1 codes; checked below
before anything else is compared.

Known differences (NVFP4_SPEC.md, "Where peers differ"), each pinned by a test here so the list
stays true:
- torchao stores the decode scale `per_tensor_scale = amax / 2688` and computes the block scale as
  `(bmax / 6) / per_tensor_scale` and the element factor as `(1 / pts) / s`; TE and fp4stack use
  `bmax * (S_enc / 6)` and `1 / (s * S_dec)` with `S_enc = 2688 / amax`. The two can differ in the
  last fp32 bit. On fp32 inputs this practically never matters (identical bytes below); on bf16
  inputs, values whose exact scaled value lies on a rounding tie (an E4M3 midpoint for the scale,
  an E2M1 tie for an element) round differently.
- torchao floors block scales at 2^-6 (the smallest normal E4M3); fp4stack keeps subnormal and zero
  block scales.
- An all-zero tensor gives torchao NaN block scales (0 / 0); fp4stack gives zero scales.
- torchao dequantizes as `value * (pts * s)`, fp4stack as `(value * s) * dec`: dequantized values
  agree to within an ulp, not bit for bit.
- torchao requires K % 16 == 0 and 2 or 3 dims; fp32 and bf16 inputs only.
"""

import pytest
import torch

import fp4stack
from fp4stack.formats import e2m1

nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")

E4M3_MIN_NORMAL = 2.0**-6


def torchao_quantize(x: torch.Tensor, amax: torch.Tensor | None = None):
    amax = x.float().abs().max() if amax is None else amax
    pts = nvfp4_tensor.per_tensor_amax_to_scale(amax)
    return nvfp4_tensor.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts)


def randn(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def test_same_packing_convention():
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 6.0, -0.5
    ta = torchao_quantize(x)
    assert ta.qdata.view(torch.uint8)[0, 0].item() == 0x97  # the spec's packing example
    assert fp4stack.quantize(x).data[0, 0].item() == 0x97
    codes = torch.arange(16, dtype=torch.uint8)
    packed = kernels.pack_uint4(codes.reshape(1, 16))
    assert torch.equal(packed, e2m1.pack(codes.reshape(1, 16)))
    assert torch.equal(kernels.unpack_uint4(packed.contiguous()), codes.reshape(1, 16))
    assert torch.equal(kernels.f4_unpacked_to_f32(codes), e2m1.code_to_value(codes))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e3])
@pytest.mark.parametrize("shape", [(64, 256), (3, 32, 64)])
def test_fp32_bytes_identical_on_normal_scales(seed, magnitude, shape):
    x = randn(*shape, seed=seed) * magnitude
    t = fp4stack.quantize(x)
    assert (t.scales.float() >= E4M3_MIN_NORMAL).all(), "precondition: normal block scales"
    ta = torchao_quantize(x)
    assert torch.equal(ta.qdata.view(torch.uint8), t.data)
    assert torch.equal(ta.scale.view(torch.uint8), t.scales.view(torch.uint8))
    torch.testing.assert_close(ta.dequantize(torch.float32), fp4stack.dequantize(t),
                               rtol=2**-22, atol=0)


def test_fp32_with_shared_amax():
    x = randn(32, 128, seed=5)
    amax = torch.tensor(3.0) * x.abs().max()
    t = fp4stack.quantize(x, amax=amax)
    ta = torchao_quantize(x, amax)
    assert torch.equal(ta.qdata.view(torch.uint8), t.data)
    assert torch.equal(ta.scale.view(torch.uint8), t.scales.view(torch.uint8))


def _is_e4m3_midpoint(v: torch.Tensor) -> torch.Tensor:
    """Whether float64 values lie (to 1e-9) halfway between two adjacent positive E4M3 values."""
    vals = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    mids = (vals[1:] + vals[:-1]) / 2
    return ((v[..., None] - mids).abs() <= 1e-9 * mids).any(-1)


def _is_e2m1_tie(y: torch.Tensor) -> torch.Tensor:
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    return ((y.abs()[..., None] - ties).abs() <= 1e-6).any(-1)


def test_bf16_differences_are_exact_ties_only():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(256, 256, generator=g) * torch.logspace(-1, 1, 256)).bfloat16()
    t = fp4stack.quantize(x)
    ta = torchao_quantize(x)
    ours_s, theirs_s = t.scales.view(torch.uint8), ta.scale.view(torch.uint8)
    xd = x.double()
    amax = xd.abs().max()
    bmax = xd.abs().reshape(256, 16, 16).amax(-1)
    exact_scale = bmax * 2688 / (6 * amax)  # the block scale before rounding, in exact-ish maths
    diff_s = ours_s != theirs_s
    assert diff_s.float().mean() < 0.02
    assert _is_e4m3_midpoint(exact_scale[diff_s]).all()
    assert ((ours_s.int() - theirs_s.int()).abs()[diff_s] == 1).all()
    # In blocks with the same scale, differing elements sit on an exact E2M1 tie.
    same = ~diff_s
    codes, codes_a = e2m1.unpack(t.data), e2m1.unpack(ta.qdata.view(torch.uint8))
    y = xd / (t.scales.double() * amax / 2688).repeat_interleave(16, -1)
    diff_c = (codes != codes_a) & same.repeat_interleave(16, -1)
    assert diff_c.float().mean() < 0.01
    assert _is_e2m1_tie(y[diff_c]).all()


def test_bf16_scale_tie_example():
    # amax = 4.0625, bmax = 3.046875 (both bf16): bmax * 2688 / (6 * amax) = 336 exactly, the
    # midpoint of E4M3 320 and 352. TE/fp4stack compute 336.00003 -> 352; torchao 336 -> 320.
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, 0], x[0, 16] = 4.0625, 3.046875
    t = fp4stack.quantize(x)
    ta = torchao_quantize(x)
    assert t.scales.float()[0, 1].item() == 352.0
    assert ta.scale.float()[0, 1].item() == 320.0


def test_subnormal_block_scales_differ():
    x = randn(4, 64, seed=6)
    x[1] *= 3e-5  # block scales ~ 448 * 3e-5 * bmax / amax: subnormal E4M3
    t = fp4stack.quantize(x)
    ta = torchao_quantize(x)
    ours, theirs = t.scales.float(), ta.scale.float()
    assert ((ours[1] > 0) & (ours[1] < E4M3_MIN_NORMAL)).all()
    assert (theirs[1] == E4M3_MIN_NORMAL).all()  # torchao's floor
    assert torch.equal(ours[[0, 2, 3]], theirs[[0, 2, 3]])  # normal rows agree
    # fp4stack's subnormal scales keep the row's accuracy; the floor loses it.
    err = (fp4stack.dequantize(t)[1] - x[1]).norm() / x[1].norm()
    err_a = (ta.dequantize(torch.float32)[1] - x[1]).norm() / x[1].norm()
    assert err < err_a


def test_all_zero_gives_nan_scales_in_torchao():
    x = torch.zeros(2, 32)
    assert torch.isnan(torchao_quantize(x).scale.float()).all()
    t = fp4stack.quantize(x)
    assert (t.scales.float() == 0).all()
    assert torch.equal(fp4stack.dequantize(t), x)
