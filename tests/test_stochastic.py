"""Stochastic rounding, tested statistically as the spec asks: adjacency, unbiasedness, and
reproducibility from a seed (or from torch's generator when no seed is given)."""

import math

import pytest
import torch

import fp4stack
from fp4stack.formats import e2m1

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GRID = e2m1.E2M1_GRID


def randn(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def sr(x, seed, **kw):
    return fp4stack.fake_quantize(x, rounding="stochastic", seed=seed, **kw)


def exact_grid_input(y_values, rows):
    """x such that, in each 16-block, the max maps to 6 with E4M3 scale 1 and y = x * enc is
    exactly each of `y_values` (up to 15 per block): amax = 2688 * 2^-4 gives S_enc = 2^4."""
    s_dec = 2.0**-4
    row = [6.0, *y_values] + [0.0] * (15 - len(y_values))
    x = torch.tensor(row, dtype=torch.float32).repeat(rows, 1) * s_dec
    return x, 2688 * s_dec, s_dec


def codes(t, k):
    return e2m1.unpack(t.data)[..., :k]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opts", [{}, {"block": (16, 16)}, {"hadamard": True}])
def test_result_is_one_of_the_two_grid_neighbours(dtype, opts):
    # Without 4/6 the block scales do not depend on the rounding, so codes compare directly.
    # Over many seeds each element takes at most two adjacent magnitude codes, the RNE code is
    # one of them, the sign is x's, and the two dequantized values bracket x.
    x = randn(32, 48, seed=1, dtype=dtype)
    target = fp4stack.rht(x) if opts.get("hadamard") else x.float()
    rne = fp4stack.quantize(x, **opts)
    ts = [fp4stack.quantize(x, rounding="stochastic", seed=s, **opts) for s in range(64)]
    assert all(torch.equal(t.scales, rne.scales) for t in ts)
    c = torch.stack([codes(t, 48) for t in ts])
    mag = (c & 7).int()
    lo, hi = mag.amin(0), mag.amax(0)
    assert (hi - lo <= 1).all()
    rne_mag = (codes(rne, 48) & 7).int()
    assert ((rne_mag == lo) | (rne_mag == hi)).all()
    negative = (c & 8) != 0
    assert torch.equal(negative[:, mag.amax(0) > 0].any(0), (target < 0)[mag.amax(0) > 0])
    # Each draw is the grid value just below or just above y = |x| / step (step = s * dec, the
    # value of one unit of the grid in this block), up to float rounding of y here.
    step = (rne.scales.float() * rne.decode_scale).repeat_interleave(16, -1)[..., :48]
    live = step > 0
    y = target.abs()[live] / step[live]
    grid = torch.tensor(GRID)
    eps = 1e-5
    below = grid[(grid[:, None] <= y * (1 + eps)).sum(0) - 1]
    above = grid[(grid[:, None] < y * (1 - eps)).sum(0).clamp(max=7)]
    drawn = grid[mag[:, live].long()]
    assert ((drawn >= below) & (drawn <= above)).all()


def test_exact_grid_values_never_move():
    x, amax, _ = exact_grid_input([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -6.0, -0.5, 0.0], rows=64)
    for seed in range(20):
        assert torch.equal(sr(x, seed, amax=amax), x)


@pytest.mark.parametrize("y", [0.1, 0.3, 0.6, 1.1, 1.7, 2.6, 3.3, 4.5, 5.9, -0.4, -2.2, -5.1])
def test_round_up_probability_is_the_distance_fraction(y):
    # 15 identical elements per row, 4096 rows, one call: each element draws independently.
    x, amax, s_dec = exact_grid_input([y] * 15, rows=4096)
    q = sr(x, seed=123, amax=amax)[:, 1:] / s_dec
    a = abs(float(torch.tensor(y, dtype=torch.float32)))
    lo = max(g for g in GRID if g <= a)
    hi = min(g for g in GRID if g > a)
    assert set(q.abs().unique().tolist()) <= {lo, hi}
    assert (torch.sign(q[q != 0]) == math.copysign(1.0, y)).all()
    p = (a - lo) / (hi - lo)
    frac_up = (q.abs() == hi).double().mean().item()
    n = q.numel()
    assert abs(frac_up - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-9


@pytest.mark.parametrize("dtype", DTYPES)
def test_mean_over_seeds_converges_to_x(dtype):
    x = randn(16, 64, seed=2, dtype=dtype)
    xf = x.float()
    n = 1000
    mean = torch.zeros_like(xf)
    for s in range(n):
        mean += sr(x, s).float()
    mean /= n
    # Only |y| <= 6 is unbiased: leave out block maxima, whose y may exceed 6 by the E4M3
    # rounding of the scale and then clamp.
    bmax = xf.abs().reshape(16, 4, 16).amax(-1, keepdim=True)
    keep = (xf.abs().reshape(16, 4, 16) < 0.9 * bmax).reshape(16, 64)
    rne_err = (fp4stack.fake_quantize(x).float() - xf)[keep].pow(2).mean().sqrt()
    mean_err = (mean - xf)[keep].pow(2).mean().sqrt()
    assert mean_err < 0.1 * rne_err, (mean_err, rne_err)
    # no systematic drift either way
    assert abs((mean - xf)[keep].mean()) < 0.02 * rne_err
    # a few draws already beat RNE on average
    mean16 = torch.stack([sr(x, 5000 + s).float() for s in range(16)]).mean(0)
    assert (mean16 - xf)[keep].pow(2).mean().sqrt() < rne_err


@pytest.mark.parametrize("opts", [{}, {"block": (16, 16)}, {"hadamard": True},
                                  {"four_over_six": True}])
def test_same_seed_same_bytes_different_seed_different_bytes(opts):
    x = randn(24, 64, seed=3)
    a = fp4stack.quantize(x, rounding="stochastic", seed=42, **opts)
    b = fp4stack.quantize(x, rounding="stochastic", seed=42, **opts)
    c = fp4stack.quantize(x, rounding="stochastic", seed=43, **opts)
    assert torch.equal(a.data, b.data) and torch.equal(a.scales, b.scales)
    assert (a.data != c.data).float().mean() > 0.1


def test_seed_none_follows_torch_manual_seed():
    x = randn(24, 64, seed=4)

    def q():
        return fp4stack.quantize(x, rounding="stochastic").data

    torch.manual_seed(7)
    a = q()
    b = q()  # the generator moved on
    torch.manual_seed(7)
    assert torch.equal(q(), a)
    assert not torch.equal(a, b)
    torch.manual_seed(7)
    assert torch.equal(fp4stack.fake_quantize(x, rounding="stochastic"),
                       fp4stack.dequantize(fp4stack.quantize(x, rounding="stochastic",
                                                             seed=_seed_after(7))))


def _seed_after(manual_seed: int) -> int:
    from fp4stack.formats.random import draw_seed

    state = torch.get_rng_state()
    torch.manual_seed(manual_seed)
    seed = draw_seed()
    torch.set_rng_state(state)
    return seed


def test_draws_depend_on_position_not_on_the_call():
    # Counter-based: rows 0..7 draw the same numbers whether or not more rows follow.
    x = randn(32, 40, seed=5)
    amax = x.abs().max()
    full = fp4stack.quantize(x, rounding="stochastic", seed=9, amax=amax)
    part = fp4stack.quantize(x[:8], rounding="stochastic", seed=9, amax=amax)
    assert torch.equal(full.data[:8], part.data)


def test_stochastic_does_not_touch_torch_rng_when_seeded():
    x = randn(8, 32, seed=6)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    fp4stack.quantize(x, rounding="stochastic", seed=1)
    assert torch.equal(torch.get_rng_state(), before)
