"""Blackwell's swizzled block-scale layout: 128x4 tiles of 512 bytes, row-major, entry (r, c) of a
tile at (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)."""

import pytest
import torch

import fp4stack

SHAPES = [(1, 1), (3, 5), (32, 4), (127, 3), (128, 4), (129, 5), (300, 17), (256, 8)]


def spec_swizzle(scales: torch.Tensor) -> torch.Tensor:
    """The spec's offset formula, one entry at a time (padding left at zero)."""
    rows, cols = scales.shape
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    out = torch.zeros(rp * cp, dtype=torch.uint8)
    raw = scales.view(torch.uint8).tolist()
    tiles_per_row = cp // 4
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * tiles_per_row + c // 4
            offset = tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)
            out[offset] = raw[r][c]
    return out


def random_scales(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    # nonzero bytes, so a zero in the output can only be padding
    raw = torch.randint(1, 0x7F, (rows, cols), generator=g, dtype=torch.uint8)
    return raw.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_the_spec_offset_formula(shape):
    s = random_scales(*shape)
    flat = fp4stack.swizzle_scales(s)
    assert flat.dtype == torch.float8_e4m3fn
    assert torch.equal(flat.view(torch.uint8), spec_swizzle(s))


@pytest.mark.parametrize("shape", SHAPES)
def test_padding_is_zero_and_sized_by_tiles(shape):
    rows, cols = shape
    flat = fp4stack.swizzle_scales(random_scales(*shape)).view(torch.uint8)
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    assert flat.numel() == rp * cp
    assert (flat != 0).sum().item() == rows * cols


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint8, torch.float32])
def test_round_trip(shape, dtype):
    raw = random_scales(*shape).view(torch.uint8)
    s = raw.float() if dtype == torch.float32 else raw.view(dtype)
    back = fp4stack.unswizzle_scales(fp4stack.swizzle_scales(s), *shape)
    assert back.dtype == dtype and back.shape == shape
    assert torch.equal(back.float() if dtype == torch.float32 else back.view(torch.uint8),
                       raw.float() if dtype == torch.float32 else raw)


def test_round_trip_of_real_nvfp4_scales():
    g = torch.Generator().manual_seed(1)
    t = fp4stack.quantize(torch.randn(200, 96, generator=g))
    flat = fp4stack.swizzle_scales(t.scales)
    assert torch.equal(fp4stack.unswizzle_scales(flat, 200, 6).view(torch.uint8),
                       t.scales.view(torch.uint8))


def test_matches_torchao_to_blocked():
    utils = pytest.importorskip("torchao.prototype.mx_formats.utils")
    for shape in SHAPES:
        s = random_scales(*shape)
        ours = fp4stack.swizzle_scales(s).view(torch.uint8)
        theirs = utils.to_blocked(s.view(torch.uint8))
        assert torch.equal(ours, theirs), shape


def test_errors():
    with pytest.raises(ValueError, match=r"\[rows, cols\]"):
        fp4stack.swizzle_scales(torch.zeros(2, 3, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="do not fit"):
        fp4stack.unswizzle_scales(torch.zeros(100, dtype=torch.uint8), 3, 5)
