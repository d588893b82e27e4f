"""Cross-check against compressed-tensors' NVFP4 (the checkpoint format vLLM loads).

compressed-tensors (0.20) has no single quantize-to-NVFP4 call; its NVFP4 scheme is assembled from
helpers, which we chain the way its compressor does for a `TENSOR_GROUP`, group_size=16 weight:
`generate_gparam` (global_scale = 2688 / amax, the *encode* scale), `calculate_qparams` (block
scale = e4m3(global_scale * bmax / 6)), `quantize` (x / (scale / global_scale), clamp, E2M1 RNE)
and `pack_fp4_to_uint8` (even element in the low nibble, as ours).

Known differences, each pinned by a test:
- Element factor: compressed-tensors divides, `x / (s / global_scale)`; TE and fp4stack multiply,
  `x * (1 / (s * S_dec))`. On fp32 inputs the bytes are identical; on bf16 inputs values whose
  exact scaled value is an E2M1 tie (and block scales on an E4M3 midpoint) can round differently.
- Zero block scales are replaced by 0.125 (its "eps" for FP8 scales); fp4stack keeps 0. In such
  blocks fp4stack's codes saturate (enc = FLT_MAX; they dequantize to 0 anyway) while
  compressed-tensors' codes are those of x / (0.125 / global_scale). Subnormal (nonzero) block
  scales agree.
- All-zero tensor: both use a global encode scale of 1 (compressed-tensors: 2688 / FLT_MIN
  overflows and is replaced by 1); its block scales are 0.125 where ours are 0. Codes are all 0.
"""

import warnings

import pytest
import torch

import fp4stack
from fp4stack.formats import e2m1

ct_scheme = pytest.importorskip("compressed_tensors.quantization.quant_scheme")
ct_helpers = pytest.importorskip("compressed_tensors.quantization.utils.helpers")
ct_forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
ct_fp4 = pytest.importorskip("compressed_tensors.compressors.nvfp4.helpers")


def ct_quantize(x: torch.Tensor):
    """(packed data, scale bytes, global_scale) as compressed-tensors computes them."""
    args = ct_scheme.NVFP4["weights"]
    m, k = x.shape
    xf = x.float()
    gs = ct_helpers.generate_gparam(xf.amin(), xf.amax())
    groups = xf.reshape(m, k // 16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scales, _ = ct_helpers.calculate_qparams(
            groups.amin(-1), groups.amax(-1), args, global_scale=gs
        )
        q = ct_forward.quantize(x=x, scale=scales, zero_point=None, args=args, global_scale=gs)
    packed = ct_fp4.pack_fp4_to_uint8(q.float())
    return packed, scales.to(torch.float8_e4m3fn).view(torch.uint8), gs


def randn(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def test_global_scale_is_our_encode_scale():
    x = randn(16, 64) * 3
    _, _, gs = ct_quantize(x)
    amax = x.abs().max()
    assert gs.item() == (torch.tensor(2688.0) / amax).item()
    assert gs.item() == fp4stack.formats.global_encode_scale(amax).item()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e3])
def test_fp32_bytes_identical(seed, magnitude):
    x = randn(64, 256, seed=seed) * magnitude
    packed, scales, _ = ct_quantize(x)
    t = fp4stack.quantize(x)
    assert torch.equal(scales, t.scales.view(torch.uint8))
    assert torch.equal(packed, t.data)


def test_fp32_subnormal_scales_agree_zero_scales_differ():
    mag = torch.logspace(-6, 3, 32, dtype=torch.float64)[:, None]
    x = (randn(32, 64, seed=4).double() * mag).float()
    packed, scales, _ = ct_quantize(x)
    t = fp4stack.quantize(x)
    ours = t.scales.view(torch.uint8)
    nonzero = t.scales.float() > 0
    assert ((t.scales.float() < 2.0**-6) & nonzero).any(), "precondition: subnormal scales"
    assert (~nonzero).any(), "precondition: zero scales"
    assert torch.equal(scales[nonzero], ours[nonzero])
    blocks = nonzero.repeat_interleave(8, -1)
    assert torch.equal(packed[blocks], t.data[blocks])
    assert (scales[~nonzero].view(torch.float8_e4m3fn).float() == 0.125).all()


def test_bf16_differences_are_exact_ties_only():
    x = (randn(256, 256, seed=5) * torch.logspace(-1, 1, 256)).bfloat16()
    packed, scales, _ = ct_quantize(x)
    t = fp4stack.quantize(x)
    same_scale = scales == t.scales.view(torch.uint8)
    assert same_scale.float().mean() > 0.95
    xd = x.double()
    amax = xd.abs().max()
    # Differing scales: the exact scaled block max is an E4M3 midpoint, one code apart.
    exact = xd.abs().reshape(256, 16, 16).amax(-1) * 2688 / (6 * amax)
    e4m3 = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    mids = (e4m3[1:] + e4m3[:-1]) / 2
    at_mid = ((exact[~same_scale][:, None] - mids).abs() <= 1e-9 * mids).any(-1)
    assert at_mid.all()
    step = (scales.int() - t.scales.view(torch.uint8).int()).abs()
    assert (step[~same_scale] == 1).all()
    y = xd / (t.scales.double() * amax / 2688).repeat_interleave(16, -1)
    diff = (e2m1.unpack(packed) != e2m1.unpack(t.data)) & same_scale.repeat_interleave(16, -1)
    assert diff.float().mean() < 0.01
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    assert ((y[diff].abs()[:, None] - ties).abs() <= 1e-6).any(-1).all()


def test_all_zero():
    x = torch.zeros(4, 32)
    packed, scales, gs = ct_quantize(x)
    assert gs.item() == 1.0 == fp4stack.formats.global_encode_scale(torch.tensor(0.0)).item()
    assert (packed == 0).all()
    assert (scales.view(torch.float8_e4m3fn).float() == 0.125).all()
    t = fp4stack.quantize(x)
    assert (t.data == 0).all() and (t.scales.view(torch.uint8) == 0).all()
