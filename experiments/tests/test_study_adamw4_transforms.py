"""experiments/study_adamw4_transforms.py: its names of state formats, and a short run."""

from __future__ import annotations

import math

import pytest
import study_adamw4_transforms as study

from fp4stack.optim import StateFormat


@pytest.mark.parametrize("name, expected", [
    ("rank1/stochastic/normalized", StateFormat()),
    ("rank1/stochastic/normalized/h2", StateFormat(headroom=2.0)),
    ("sqrt/rne/direct/current", StateFormat("sqrt", "rne", "direct", "current")),
])
def test_names_build_state_formats(name, expected):
    assert study.state_format(name) == expected


def test_a_bad_name_fails_on_the_field():
    with pytest.raises(ValueError, match="rounding"):
        study.state_format("rank1/nearest/normalized")


def test_a_variant_trains():
    loss, state_bytes = study.train("rows", 0, 2, "sqrt/rne/direct/current")
    assert math.isfinite(loss) and 0 < state_bytes < 8
