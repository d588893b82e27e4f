"""The benchmarks' per-kernel profile: names, the table, and (on a GPU) the timings."""

from __future__ import annotations

import pytest
import torch

from fp4stack.kernels.profiling import format_kernel_times, kernel_times, short_name


def test_short_name_drops_the_parameter_list_only():
    cxx = ("void at::native::vectorized_elementwise_kernel<4, at::native::AbsFunctor<float>, "
           "std::array<char*, 2ul> >(int, at::native::AbsFunctor<float>, std::array<char*, 2ul>)")
    assert short_name(cxx, width=200) == ("at::native::vectorized_elementwise_kernel<4, "
                                          "at::native::AbsFunctor<float>, std::array<char*, 2ul> >")
    assert short_name("attention_fwd_kernel") == "attention_fwd_kernel"
    assert len(short_name("k" * 100)) == 70


def test_table_shares_and_the_rest_row():
    rows = [("a", 2, 3.0), ("b", 1, 0.5), ("c", 4, 0.5)]
    lines = format_kernel_times(rows, limit=1).splitlines()
    assert lines[2] == "| a | 2 | 3.000 | 75.0% |"
    assert lines[3] == "| (2 others) | 5 | 1.000 | 25.0% |"
    assert lines[4] == "| total | 7 | 4.000 | 100% |"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_times_counts_launches_per_call():
    x = torch.randn(1 << 20, device="cuda")
    rows = kernel_times(lambda: x * 2, reps=3)  # one elementwise kernel per call
    assert len(rows) == 1 and rows[0][1] == 1 and rows[0][2] > 0, rows
    assert "elementwise" in rows[0][0], rows
