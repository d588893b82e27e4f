"""The counter-based draws of formats/random.py: the lowbias32 hash in its three forms (int64
tensor, Python int, and an independent numpy uint32 version), and the uniform draws."""

import numpy as np
import pytest
import spec_oracle as oracle
import torch

from fp4stack.formats import random as rnd

EDGE_U32 = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFF, 0x10000, 0xFFFFFFFE, 0xFFFFFFFF]


def u32_samples(n=4096, seed=0):
    rng = np.random.default_rng(seed)
    return np.concatenate([np.array(EDGE_U32, np.uint64), rng.integers(0, 2**32, n, np.uint64)])


def lowbias32_numpy(x: np.ndarray) -> np.ndarray:
    # Written out again here on uint32 with wrap-around multiplies (independent of the oracle's).
    x = x.astype(np.uint32)
    with np.errstate(over="ignore"):
        for shift, mul in ((16, 0x7FEB352D), (15, 0x846CA68B)):
            x = (x ^ (x >> np.uint32(shift))) * np.uint32(mul)
    return x ^ (x >> np.uint32(16))


def test_lowbias32_tensor_int_and_numpy_agree():
    xs = u32_samples()
    t = rnd.lowbias32(torch.from_numpy(xs.astype(np.int64))).numpy()
    ints = np.array([rnd.lowbias32_int(int(v)) for v in xs], np.int64)
    npy = lowbias32_numpy(xs).astype(np.int64)
    np.testing.assert_array_equal(t, ints)
    np.testing.assert_array_equal(t, npy)
    np.testing.assert_array_equal(oracle.lowbias32_np(xs).astype(np.int64), npy)
    assert t.min() >= 0 and t.max() < 2**32


def test_lowbias32_int_masks_to_32_bits():
    for v in (2**32, 2**40 + 5, -1, -(2**33) + 7):
        assert rnd.lowbias32_int(v) == rnd.lowbias32_int(v & 0xFFFFFFFF)


def test_lowbias32_is_injective_on_a_range():
    x = torch.arange(1 << 16, dtype=torch.int64) * 65537
    assert rnd.lowbias32(x).unique().numel() == x.numel()


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**31, 2**32 + 3, 2**62 - 1, 2**63 - 1])
def test_uniform_matches_the_numpy_transcription(seed):
    idx = np.concatenate([np.arange(2048), np.array([2**32 - 1, 2**32, 2**32 + 1, 2**40 + 77])])
    got = rnd.uniform(torch.from_numpy(idx.astype(np.int64)), seed).numpy()
    want = oracle.uniform_np(idx.astype(np.uint64), seed)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("seed", [0, 7, 2**40 + 1])
def test_uniform_range_grid_and_rough_uniformity(seed):
    n = 1 << 16
    u = rnd.uniform(torch.arange(n, dtype=torch.int64), seed)
    assert u.dtype == torch.float32
    assert (u >= 0).all() and (u < 1).all()
    assert torch.equal(u * 2**24, (u * 2**24).floor())  # on the 2^-24 grid
    # chi-square over 64 bins: mean 63, sd ~11; a loose bound catches real non-uniformity.
    counts = torch.bincount((u * 64).long(), minlength=64).double()
    expected = n / 64
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 140, chi2
    assert abs(u.double().mean().item() - 0.5) < 0.01
    # neighbouring indices are uncorrelated
    corr = np.corrcoef(u[:-1].numpy(), u[1:].numpy())[0, 1]
    assert abs(corr) < 0.02


def test_streams_differ_by_seed_and_by_high_index_bits():
    idx = torch.arange(4096, dtype=torch.int64)
    a = rnd.uniform(idx, 1)
    assert (a != rnd.uniform(idx, 2)).float().mean() > 0.99
    assert (a != rnd.uniform(idx, 1 + 2**32)).float().mean() > 0.99  # the seed's high half counts
    assert (a != rnd.uniform(idx + 2**32, 1)).float().mean() > 0.99  # the index's high half too


def test_seed_keys_are_32_bit_for_any_seed():
    for seed in (0, 1, 2**32 - 1, 2**32, 2**64 + 3, -5):
        k1, k2 = rnd.seed_keys(seed)
        assert 0 <= k1 < 2**32 and 0 <= k2 < 2**32


def test_draw_seed_follows_torch_generator():
    torch.manual_seed(3)
    a, b = rnd.draw_seed(), rnd.draw_seed()
    torch.manual_seed(3)
    assert rnd.draw_seed() == a
    assert a != b and 0 <= a < 2**62
    g = torch.Generator().manual_seed(3)
    assert rnd.draw_seed(g) == a


def test_stream_seed_is_a_pure_function_of_its_keys():
    """The seed of a micro-batch's stochastic-rounding stream: the same keys in any process,
    63 bits (torch's generator takes it), different keys apart."""
    from fp4stack.formats.random import stream_seed

    seeds = {stream_seed(0, step, j) for step in range(20) for j in range(8)}
    assert len(seeds) == 160 and all(0 <= s < 2**63 for s in seeds)
    assert stream_seed(5, 7, 3) == stream_seed(5, 7, 3) != stream_seed(5, 3, 7)
