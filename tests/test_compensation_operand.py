"""kernels.compensation (QUADS's operand x~ in two launches) against its definition in torch:
Q(x) by the reference quantizer, the channel energy of nn.compensation, the k channels of highest
energy (ties lowest index first), x put back there. Dense layers and the grouped MoE's pairs
(each expert's amax, energies and channels over the rows it receives).

On CPU the kernels run under the Triton interpreter; on a GPU compiled. Random activations
leave no energies tied to the last bit, so the masks, and with them x~, are compared exactly.
"""

from __future__ import annotations

import pytest
import torch

from fp4stack import QuantSpec, fake_quantize
from fp4stack.nn.compensation import top_indices

pytest.importorskip("triton")
from fp4stack.kernels import moe_align  # noqa: E402
from fp4stack.kernels.compensation import (  # noqa: E402
    DENSE_TILE,
    MAX_ROW_SPLITS,
    compensated_operand,
    operand_supported,
    row_splits,
)

pytestmark = pytest.mark.usefixtures("one_thread")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPECS = {
    "tensor": QuantSpec(nan_policy="propagate"),
    "row": QuantSpec(nan_policy="propagate", global_scale="row"),
    "4over6": QuantSpec(nan_policy="propagate", four_over_six=True),
}


def activations(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1, 1, k)[torch.randperm(k, generator=g)]  # outlier channels
    return (torch.randn(m, k, generator=g) * scale).to(DEVICE, dtype)


def x_tilde(x, spec, count, norms, amax=None):
    """The definition: x~ = Q(x) with the `count` channels of highest energy set to x."""
    q = fake_quantize(x, spec=spec, amax=amax)
    energy = (x - q).float().pow(2).sum(0) * norms
    channels = top_indices(energy, count)
    return q.index_copy(1, channels, x[:, channels])


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(1, 64), (5, 80), (DENSE_TILE + 3, 40), (40, 48)])
def test_dense_operand_is_the_definition(spec, dtype, m, k):
    x = activations(m, k, dtype, seed=m + k)
    norms = torch.rand(k, generator=torch.Generator().manual_seed(k)).to(DEVICE)
    for count in (1, 5, k - 1):
        got = compensated_operand(x, SPECS[spec], count, norms)
        assert got.dtype == dtype and got.shape == (m, k)
        assert torch.equal(got, x_tilde(x, SPECS[spec], count, norms))


@pytest.mark.parametrize("here", [True, False], ids=["amax-in-kernel", "amax-launch-first"])
@pytest.mark.parametrize("spec", ["tensor", "row"])
def test_dense_amax_inside_the_first_launch_or_before_it(spec, here, monkeypatch):
    """A small operand's amax computed by the first launch's programs (a decoding step's, one
    launch fewer) or by the amax kernel before it: the definition's x~ both ways."""
    from fp4stack.kernels import nvfp4 as kernels

    for name in ("AMAX_HERE_READS", "INTERPRETED_AMAX_HERE_READS"):
        monkeypatch.setattr(kernels, name, 1 << 40 if here else 0)
    x = activations(DENSE_TILE + 3, 48, torch.float32, seed=3)
    norms = torch.rand(48, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert torch.equal(compensated_operand(x, SPECS[spec], 5, norms),
                       x_tilde(x, SPECS[spec], 5, norms))


def test_dense_edges():
    spec = SPECS["tensor"]
    x = activations(7, 64, torch.float32)
    norms = torch.rand(64, device=DEVICE)
    assert torch.equal(compensated_operand(x, spec, 64, norms), x)  # every channel: x itself
    assert torch.equal(compensated_operand(x, spec, 0, norms), fake_quantize(x, spec=spec))
    amax = torch.tensor(3.0 * x.abs().max().item(), device=DEVICE)  # a static activation amax
    assert torch.equal(compensated_operand(x, spec, 4, norms, amax=amax),
                       x_tilde(x, spec, 4, norms, amax=amax))
    # A channel whose weight column is zero has no energy: never chosen before the others.
    norms[:60] = 0.0
    got = compensated_operand(x, spec, 4, norms)
    assert torch.equal(got[:, 60:], x[:, 60:])
    assert torch.equal(got[:, :60], fake_quantize(x, spec=spec)[:, :60])
    with pytest.raises(ValueError, match="row-scaled"):
        compensated_operand(x, SPECS["row"], 4, norms, amax=amax)
    assert not operand_supported(QuantSpec(rounding="stochastic"), 64)
    assert not operand_supported(QuantSpec(block=(16, 16)), 64)
    with pytest.raises(ValueError, match="not supported"):
        compensated_operand(x, QuantSpec(hadamard=True), 4, norms)


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_m", [4, 16])
def test_grouped_operand_is_each_experts_definition(spec, dtype, block_m):
    t, top_k, n_experts, k = 13, 2, 5, 48
    g = torch.Generator().manual_seed(block_m)
    logits = torch.randn(t, n_experts, generator=g)
    logits[:, 3] = -1e9  # an expert that receives no token
    indices = logits.topk(top_k, dim=-1).indices.to(DEVICE)
    x = activations(t, k, dtype, seed=3)
    norms = torch.rand(n_experts, k, generator=g).to(DEVICE)
    al = moe_align.align_pairs(indices, n_experts, block_m)
    groups = indices.reshape(-1)
    s = SPECS[spec]
    amax = None if s.row_scaled else moe_align.group_amax(x, top_k, groups, n_experts)
    got = compensated_operand(x, s, 6, norms, amax=amax, alignment=al, row_div=top_k)
    assert got.shape == (t * top_k, k) and got.dtype == dtype
    pairs_x = x.repeat_interleave(top_k, dim=0)  # pair p reads x[p // top_k]
    for e in range(n_experts):
        mine = (groups == e).nonzero().flatten()
        if not mine.numel():
            continue
        rows = pairs_x[mine]
        want = x_tilde(rows, s, 6, norms[e], amax=None if s.row_scaled else amax[e])
        assert torch.equal(got[mine], want), e


@pytest.mark.parametrize("spec", ["tensor", "row"])
def test_siblings_share_one_quantization_and_choose_their_own_channels(spec):
    # q/k/v of one input: one Q(x) and one residual sum, an x~ per sibling by its own norms.
    x = activations(DENSE_TILE + 2, 64, torch.bfloat16, seed=9)
    norms = torch.rand(3, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    got = compensated_operand(x, SPECS[spec], 5, norms)
    assert got.shape == (3, DENSE_TILE + 2, 64)
    for j in range(3):
        assert torch.equal(got[j], x_tilde(x, SPECS[spec], 5, norms[j]))
    assert not torch.equal(got[0], got[1])  # other norms, other channels


def random_keep(rows: int, k: int, count: int, seed: int) -> torch.Tensor:
    """[rows, k] bool, `count` True per row at random channels."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.zeros(rows, k, dtype=torch.bool)
    for r in range(rows):
        keep[r, torch.randperm(k, generator=g)[:count]] = True
    return keep.to(DEVICE)


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_channels_are_q_of_x_with_x_at_the_kept_ones(spec, dtype):
    """keep= (calibrated channels): x~ = where(keep, x, Q(x)) in one launch, for a layer, its
    siblings (a mask each) and a grouped MoE's pairs (each expert's mask and amax)."""
    s = SPECS[spec]
    rows = MAX_ROW_SPLITS * DENSE_TILE + 3  # one more tile than programs share them out
    x = activations(rows, 48, dtype, seed=4)
    q = fake_quantize(x, spec=s)
    keep = random_keep(3, 48, 7, seed=1)
    assert torch.equal(compensated_operand(x, s, 0, None, keep=keep[0]),
                       torch.where(keep[0], x, q))
    got = compensated_operand(x, s, 0, None, keep=keep)
    assert got.shape == (3, rows, 48)
    for j in range(3):
        assert torch.equal(got[j], torch.where(keep[j], x, q))
    assert torch.equal(compensated_operand(x, s, 0, None, keep=torch.ones_like(keep[0])), x)

    t, top_k, n_experts = 29, 2, 4
    indices = torch.randn(t, n_experts, generator=torch.Generator().manual_seed(5)
                          ).topk(top_k, dim=-1).indices.to(DEVICE)
    x = activations(t, 48, dtype, seed=6)
    keep = random_keep(n_experts, 48, 5, seed=2)
    groups = indices.reshape(-1)
    amax = None if s.row_scaled else moe_align.group_amax(x, top_k, groups, n_experts)
    got = compensated_operand(x, s, 0, None, amax=amax, keep=keep, row_div=top_k,
                              alignment=moe_align.align_pairs(indices, n_experts, 4))
    pairs_x = x.repeat_interleave(top_k, dim=0)
    for e in range(n_experts):
        mine = (groups == e).nonzero().flatten()
        if mine.numel():
            rows = pairs_x[mine]
            q = fake_quantize(rows, spec=s, amax=None if s.row_scaled else amax[e])
            assert torch.equal(got[mine], torch.where(keep[e], rows, q)), e
    with pytest.raises(ValueError, match="must end in K=48"):
        compensated_operand(x, s, 0, None, keep=keep[:, :40])


def test_static_row_tiles_are_shared_out_and_dynamic_ones_walked_in_order():
    assert row_splits(256, None, static=False) == 1  # the sums add the tiles in order
    assert row_splits(256, None, static=True) == min(MAX_ROW_SPLITS, 256 // DENSE_TILE)
    assert row_splits(1, None, static=True) == 1
    indices = torch.arange(64).reshape(32, 2).remainder(8).to(DEVICE)
    al = moe_align.align_pairs(indices, 8, 4)
    assert row_splits(32, al, static=True) == -(-al.tile_expert.numel() // 8)
    assert row_splits(32, al, static=False) == 1
