"""kernels.top_mask (QUADS's channel choice during decoding) against the reference rule,
`nn.compensation.top_indices` (the first k of a stable descending sort), and torch.topk where
there are no ties. On CPU the kernel runs under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4stack.nn.compensation import top_indices

pytest.importorskip("triton")
from fp4stack.kernels.top_mask import MAX_LENGTH, stable_top_mask, top_mask  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference_mask(values: torch.Tensor, k: int) -> torch.Tensor:
    mask = torch.zeros(values.numel(), dtype=torch.bool)
    mask[top_indices(values.cpu(), k)] = True
    return mask


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 300), k_frac=st.floats(0, 1), levels=st.sampled_from([2, 5, 1000]),
       seed=st.integers(0, 2**31 - 1))
def test_matches_the_stable_sort_rule_with_ties(n, k_frac, levels, seed):
    g = torch.Generator().manual_seed(seed)
    # Few distinct levels: many ties at the k-th value; zeros and huge values among them.
    table = torch.tensor([0.0, 1e-30, 0.5, 3.0, 3e38])[torch.randint(0, 5, (levels,),
                                                                      generator=g)]
    values = torch.where(torch.rand(n, generator=g) < 0.5,
                         table[torch.randint(0, levels, (n,), generator=g)],
                         torch.rand(n, generator=g) * 10)
    k = round(k_frac * n)
    got = top_mask(values.to(DEVICE), k).cpu()
    assert int(got.sum()) == max(0, min(k, n))
    assert torch.equal(got, reference_mask(values, k))


@pytest.mark.parametrize("n", [7, 1024, 5000])
def test_no_ties_equals_torch_topk(n):
    g = torch.Generator().manual_seed(n)
    values = torch.rand(n, generator=g) * torch.logspace(-20, 20, n)
    k = max(1, n // 10)
    want = torch.zeros(n, dtype=torch.bool)
    want[torch.topk(values, k).indices] = True
    assert torch.equal(top_mask(values.to(DEVICE), k).cpu(), want)


def test_special_values_order_as_torch_sort():
    # NaN above +inf (torch's sort puts it first when descending); +0 lowest.
    values = torch.tensor([0.0, float("inf"), 1.0, float("nan"), 2.0, 0.0])
    for k in range(7):
        assert torch.equal(top_mask(values.to(DEVICE), k).cpu(), reference_mask(values, k)), k


def test_edges_and_errors():
    v = torch.rand(10, device=DEVICE)
    assert not top_mask(v, 0).any() and top_mask(v, 10).all() and top_mask(v, 99).all()
    assert top_mask(v[:0], 3).numel() == 0
    with pytest.raises(ValueError, match="float32 vector"):
        top_mask(v.double(), 2)
    with pytest.raises(ValueError, match="float32 vector"):
        top_mask(v.reshape(2, 5), 2)


def test_long_vectors_take_the_stable_sort():
    values = torch.rand(MAX_LENGTH + 5)
    values[::7] = 0.25  # ties
    k = MAX_LENGTH // 3
    assert torch.equal(top_mask(values, k), stable_top_mask(values, k))
    assert torch.equal(stable_top_mask(values, k), reference_mask(values, k))
