"""E2M1 element format: the spec's RNE table, ties, saturation, signs, codes and nibble packing."""

import numpy as np
import pytest
import torch

from fp4stack.formats import e2m1

GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# (tie point, magnitude code it rounds to): the even code wins (spec, "Ties go to the even code").
TIES = ((0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6))


def codes_of(values) -> list[int]:
    return e2m1.round_rne(torch.tensor(values, dtype=torch.float32)).tolist()


def spec_table_code(a: float) -> int:
    """Magnitude code of |y| = a, from the spec's table (one row per interval)."""
    rows = (
        (lambda v: v <= 0.25, 0),
        (lambda v: 0.25 < v < 0.75, 1),
        (lambda v: 0.75 <= v <= 1.25, 2),
        (lambda v: 1.25 < v < 1.75, 3),
        (lambda v: 1.75 <= v <= 2.5, 4),
        (lambda v: 2.5 < v < 3.5, 5),
        (lambda v: 3.5 <= v <= 5.0, 6),
        (lambda v: v > 5.0, 7),
    )
    (code,) = [c for test, c in rows if test(a)]
    return code


@pytest.mark.parametrize("tie,code", TIES)
def test_tie_points_round_to_even(tie, code):
    assert codes_of([tie]) == [code]
    assert codes_of([-tie]) == [code | 8]
    assert code % 2 == 0


@pytest.mark.parametrize("tie,code", TIES)
def test_just_above_and_below_ties(tie, code):
    t = np.float32(tie)
    below = float(np.nextafter(t, np.float32(0)))
    above = float(np.nextafter(t, np.float32(10)))
    lower_code = code if tie in (0.25, 1.25, 2.5, 5.0) else code - 1
    assert codes_of([below, above]) == [lower_code, lower_code + 1]
    assert codes_of([-below, -above]) == [lower_code | 8, (lower_code + 1) | 8]


@pytest.mark.parametrize("code,value", list(enumerate(GRID)))
def test_grid_values_are_fixed_points(code, value):
    assert codes_of([value]) == [code]
    v = torch.tensor([code, code | 8], dtype=torch.uint8)
    assert e2m1.code_to_value(v).tolist() == [value, -value]


def test_dense_sweep_matches_the_spec_table():
    # Every float32 on a fine grid over [0, 7], plus all the ulp neighbours of the breakpoints.
    vals = np.linspace(0.0, 7.0, 7001, dtype=np.float32)
    breaks = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], np.float32)
    vals = np.concatenate([vals, breaks, np.nextafter(breaks, 0), np.nextafter(breaks, 10)])
    got = e2m1.round_rne(torch.from_numpy(vals)).numpy()
    want = np.array([spec_table_code(float(v)) for v in vals])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("y", [6.0, 6.5, 100.0, 3.0e38, float("inf")])
def test_saturates_above_six(y):
    assert codes_of([y, -y]) == [7, 15]


def test_negative_rounding_to_zero_is_code_8():
    assert codes_of([-0.25, -0.1, -1e-30, -float(np.float32(2.0**-149))]) == [8, 8, 8, 8]


def test_negative_zero_and_nan_are_code_0():
    assert codes_of([-0.0, 0.0, float("nan"), -float("nan")]) == [0, 0, 0, 0]


def test_code_to_value_table():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = e2m1.code_to_value(codes)
    assert vals.dtype == torch.float32
    assert vals[:8].tolist() == list(GRID)
    assert vals[8:].tolist() == [-g for g in GRID]
    assert torch.signbit(vals[8]).item()  # code 8 is -0


def test_round_trip_codes_through_values():
    codes = torch.arange(16, dtype=torch.uint8)
    back = e2m1.round_rne(e2m1.code_to_value(codes))
    # -0.0 (code 8) comes back as code 0, as the spec's reference does for a -0.0 input.
    expected = codes.clone()
    expected[8] = 0
    assert torch.equal(back, expected)


def test_pack_example_from_spec():
    codes = e2m1.round_rne(torch.tensor([6.0, -0.5]))
    assert e2m1.pack(codes).tolist() == [0x97]


def test_pack_layout_even_index_low_nibble():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 5, 32), generator=g, dtype=torch.uint8)
    packed = e2m1.pack(codes)
    assert packed.shape == (3, 5, 16) and packed.dtype == torch.uint8
    for i in range(16):
        assert torch.equal(packed[..., i], codes[..., 2 * i] + 16 * codes[..., 2 * i + 1])


def test_pack_unpack_round_trip():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (4, 2, 48), generator=g, dtype=torch.uint8)
    assert torch.equal(e2m1.unpack(e2m1.pack(codes)), codes)
    data = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    assert torch.equal(e2m1.pack(e2m1.unpack(data)), data)


def test_pack_rejects_odd_length():
    with pytest.raises(ValueError, match="even"):
        e2m1.pack(torch.zeros(3, 5, dtype=torch.uint8))


def test_stochastic_with_extreme_draws_brackets_rne():
    # u -> 0 always rounds up when y is off-grid; u -> 1 never does: the two grid neighbours.
    y = torch.linspace(-6.0, 6.0, 2401)
    lo = e2m1.code_to_value(e2m1.round_stochastic(y, torch.full_like(y, 1.0 - 2.0**-24))).abs()
    hi = e2m1.code_to_value(e2m1.round_stochastic(y, torch.zeros_like(y))).abs()
    a = y.abs()
    assert (lo <= a).all() and (hi >= a).all()
    rne = e2m1.code_to_value(e2m1.round_rne(y)).abs()
    assert ((rne == lo) | (rne == hi)).all()
    on_grid = torch.isin(a, torch.tensor(GRID))
    assert torch.equal(lo[on_grid], a[on_grid]) and torch.equal(hi[on_grid], a[on_grid])
