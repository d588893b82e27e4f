"""packed_linear (a GEMM on packed NVFP4 weights, dequantized in registers) against
`a @ fp4stack.dequantize(w, a.dtype).T`, and QuantLinear's fused inference path against its
reference path.

Bit-exact where every product and partial sum is exact (weights built on the NVFP4 grid with
amax making D = 1, small-integer activations), within a float32 accumulation bound on random
inputs. On CPU the kernels run under the Triton interpreter; on a GPU compiled, where the
gpu-marked tests also check that the fused paths never sync with the host.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import fp4stack
from fp4stack import QuantLinear, QuantSpec, recipe
from fp4stack.formats import nvfp4 as reference
from fp4stack.nn import linear as linear_mod
from fp4stack.nn import operands as operands_mod

pytest.importorskip("triton")
from fp4stack.kernels import packed_gemm as pg  # noqa: E402
from fp4stack.kernels.top_mask import top_mask  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
SPECS = {"1x16": QuantSpec(), "16x16": QuantSpec(block=(16, 16)),
         "4/6": QuantSpec(four_over_six=True)}
# Small configs so that the tiny test shapes have partial tiles in M, N and K, and split-K.
SMALL = {
    "gemv": pg.GemmConfig(4, 16, 32, split_k=1, dot=False),
    "gemv-split3": pg.GemmConfig(2, 16, 16, split_k=3, dot=False),
    "dot": pg.GemmConfig(16, 16, 32, split_k=1),
    "dot-split2": pg.GemmConfig(16, 32, 32, split_k=2),
}


def grid_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """[n, k] whose 16-blocks are E2M1 grid values times a power-of-two scale (one per 16x16
    tile, so 2D tiles fit too), each block's first element ±6: quantized with amax =
    6 * scale_max (D = 1) it is exact, and every product with a small integer, and every
    partial sum, is exact in float32."""
    g = torch.Generator().manual_seed(seed)
    kp = -(-k // 16) * 16
    vals = GRID[torch.randint(0, 8, (n, kp), generator=g)]
    vals *= torch.where(torch.rand(n, kp, generator=g) < 0.5, -1.0, 1.0)
    vals[:, ::16] = 6.0
    tiles = 2.0 ** torch.randint(-2, 3, (-(-n // 16), kp // 16), generator=g).float()
    scale = tiles.repeat_interleave(16, dim=0)[:n]
    return (vals.reshape(n, kp // 16, 16) * scale[..., None]).reshape(n, kp)[:, :k]


def small_ints(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, (m, k), generator=g).float()


def quantized(w: torch.Tensor, spec: QuantSpec, amax=None):
    return reference.quantize(w, spec, amax=amax).to(DEVICE)


def expected(a: torch.Tensor, t, bias=None) -> torch.Tensor:
    """The reference: a @ dequantize(w, a.dtype)ᵀ in float32, rounded to a.dtype, plus the bias
    as QuantLinear adds it (y + bias.to(dtype))."""
    w = t if isinstance(t, torch.Tensor) else fp4stack.dequantize(t, a.dtype)
    y = (a.float() @ w.float().t()).to(a.dtype)
    return y if bias is None else y + bias.to(a.dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view({4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_inputs_bit_exact(spec_name, dtype):
    spec = SPECS[spec_name]
    n, k = 40, 80  # N and K not multiples of the tiles
    t = quantized(grid_weight(n, k, seed=1), spec, amax=6.0 * spec.scale_max)
    assert torch.equal(fp4stack.dequantize(t).cpu(), grid_weight(n, k, seed=1))  # D = 1, exact
    bias = torch.randn(n).to(DEVICE)
    for m in (1, 3, 17, 64):  # the heuristic's configs: gemv, swapped and plain dots
        a = small_ints(m, k, seed=m).to(DEVICE, dtype)
        got = pg.packed_linear(a, t, bias)
        assert got.dtype == dtype and got.shape == (m, n)
        assert torch.equal(bits(got), bits(expected(a, t, bias))), m


@pytest.mark.parametrize("config", list(SMALL))
def test_small_tiles_and_split_k_bit_exact(config):
    n, k = 40, 80
    t = quantized(grid_weight(n, k, seed=1), QuantSpec(), amax=2688.0)
    bias = torch.randn(n).to(DEVICE)
    for m, dtype in ((3, torch.float32), (17, torch.bfloat16)):
        a = small_ints(m, k, seed=m).to(DEVICE, dtype)
        got = pg.packed_linear(a, t, bias, config=SMALL[config])
        assert torch.equal(bits(got), bits(expected(a, t, bias))), (m, config)


@pytest.mark.parametrize("config", list(pg.GEMM_CONFIGS))
def test_table_configs_bit_exact(config):
    n, k = 24, 48
    t = quantized(grid_weight(n, k, seed=2), QuantSpec(), amax=2688.0)
    for m in (1, 17):
        a = small_ints(m, k, seed=m).to(DEVICE, torch.bfloat16)
        got = pg.packed_linear(a, t, config=pg.GEMM_CONFIGS[config])
        assert torch.equal(bits(got), bits(expected(a, t)))


@pytest.mark.parametrize("sizes", [(32, 16, 16), (16, 32), (20, 12, 16)])
@pytest.mark.parametrize("config", ["dot", "gemv-split3"])
def test_segments_read_one_operand_per_sibling_bit_exact(sizes, config):
    # Siblings' rows side by side, each multiplied by its own operand: in one launch when the
    # boundaries are whole tiles of block_n (16 here), else one launch per sibling (20, 12).
    n, k = sum(sizes), 80
    t = quantized(grid_weight(n, k, seed=5), QuantSpec(), amax=2688.0)
    bias = torch.randn(n).to(DEVICE)
    a = torch.stack([small_ints(5, k, seed=j) for j in range(len(sizes))]).to(DEVICE)
    got = pg.packed_linear(a, t, bias, config=SMALL[config], segments=sizes)
    ends = torch.tensor(sizes).cumsum(0).tolist()
    want = torch.cat([expected(a[j], t, bias)[:, e - size:e]
                      for j, (size, e) in enumerate(zip(sizes, ends, strict=True))], dim=1)
    assert torch.equal(bits(got), bits(want))
    with pytest.raises(ValueError, match="segments"):
        pg.packed_linear(a, t, segments=(n,))


def test_narrower_tiles_make_sibling_boundaries_whole():
    cfg = pg.GEMM_CONFIGS["dot64x128x64"]
    assert pg.narrower_tiles(cfg, [576, 768]).block_n == 64  # q/k/v of dim 576, 3 kv heads
    assert pg.narrower_tiles(cfg, [576, 768]).block_k == cfg.block_k  # the K loop as before
    assert pg.narrower_tiles(cfg, [256, 512]) is cfg  # already whole tiles
    assert pg.narrower_tiles(cfg, [20, 40]) is cfg  # no tile of >= 16 fits: one launch each
    swapped = pg.GEMM_CONFIGS["swap16x64x128"]
    assert pg.narrower_tiles(swapped, [32, 64]) is swapped  # wgmma's swap needs block_n >= 64


def test_segments_take_one_launch_with_narrower_tiles(monkeypatch):
    # 100 rows take the table's block_n-128 config; boundaries at 64 and 128 rows fit 64.
    sizes, k = (64, 64, 64), 80
    t = quantized(grid_weight(sum(sizes), k, seed=6), QuantSpec(), amax=2688.0)
    a = torch.stack([small_ints(100, k, seed=j) for j in range(3)]).to(DEVICE, torch.bfloat16)
    assert pg.choose_config(100, sum(sizes), k, a.device, a.dtype)[0].block_n == 128
    launches = []
    dense = pg._dense
    monkeypatch.setattr(pg, "_dense", lambda *args, **kw: launches.append(1) or dense(*args, **kw))
    got = pg.packed_linear(a, t, segments=sizes)
    assert len(launches) == 1
    want = torch.cat([expected(a[j], t)[:, 64 * j:64 * (j + 1)] for j in range(3)], dim=1)
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("magnitude", [1e-38, 1e-30, 1e-3, 1.0, 7.0, 1e20, 3e38])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_weight_value_bit_exact_at_any_scale(magnitude, dtype):
    """a = I gives y = Wᵀ with one nonzero product per output, so the kernel's decode of every
    value ((e2m1 * scale) * D, by the kernels' two-factor split) is compared bit for bit with
    dequantize, for global amaxes from the capped decode factor (1e-38) to near FLT_MAX and
    block scales from E4M3 subnormals to 448 (each row spans six decades)."""
    if dtype == torch.bfloat16 and magnitude < 1e-30 and not CUDA:
        pytest.skip("the Triton interpreter mis-converts subnormal bfloat16 values (those "
                    "below 1.2e-38); the GPU runs this case")
    g = torch.Generator().manual_seed(7)
    n, k = 48, 64
    w = torch.randn(n, k, generator=g) * 10.0 ** torch.linspace(-6, 0, n)[:, None]
    w = (w / w.abs().max() * magnitude).float()
    t = quantized(w, QuantSpec())
    want = fp4stack.dequantize(t, dtype).t()
    for config in (None, SMALL["dot"], SMALL["gemv"]):
        got = pg.packed_linear(torch.eye(k, dtype=dtype, device=DEVICE), t, config=config)
        assert torch.equal(got.cpu(), want.cpu()), config


def test_k_not_a_multiple_of_16_and_fp16():
    # K = 70 leaves 10 padded columns in the last block, which must not reach the sums.
    n, k = 20, 70
    t = quantized(grid_weight(n, k, seed=3), QuantSpec(), amax=2688.0)
    assert t.data.shape == (n, 40)
    for dtype, cfg in ((torch.float16, SMALL["gemv"]), (torch.float32, SMALL["dot-split2"])):
        a = small_ints(5, k, seed=4).to(DEVICE, dtype)
        got = pg.packed_linear(a, t, config=cfg)
        assert torch.equal(bits(got), bits(expected(a, t)))


def test_nan_block_in_the_padding_stays_out():
    # A NaN block scale: the reference's dequantize cuts the padding off; its row is NaN, and
    # the padding past K of that block must not make other columns' sums NaN.
    n, k = 4, 24
    w = grid_weight(n, k, seed=5)
    t = quantized(w, QuantSpec(), amax=2688.0)
    scales = t.scales.view(torch.uint8).clone()
    scales[1, 1] = 0x7F  # row 1, the block holding columns 16..23 and the padding
    t = replace(t, scales=scales.view(torch.float8_e4m3fn))
    a = small_ints(3, k, seed=6).to(DEVICE)
    got = pg.packed_linear(a, t, config=SMALL["dot"]).cpu()
    want = expected(a, t).cpu()
    assert torch.isnan(got[:, 1]).all() and not torch.isnan(got[:, [0, 2, 3]]).any()
    assert torch.equal(got[:, [0, 2, 3]], want[:, [0, 2, 3]])


def test_plain_weight_path_bit_exact():
    w = grid_weight(36, 64, seed=7).to(DEVICE)
    for dtype, cfg in ((torch.float32, SMALL["gemv"]), (torch.bfloat16, SMALL["dot-split2"])):
        a = small_ints(9, 64, seed=8).to(DEVICE, dtype)
        got = pg.packed_linear(a, w.to(dtype), config=cfg)
        assert torch.equal(bits(got), bits(expected(a, w.to(dtype))))
    with pytest.raises(TypeError, match="a's dtype"):
        pg.packed_linear(a, w)


def test_bad_operands_are_named():
    t = quantized(grid_weight(8, 32, seed=0), QuantSpec(), amax=2688.0)
    with pytest.raises(ValueError, match=r"a must be \[M, 32\]"):
        pg.packed_linear(torch.zeros(2, 16, device=DEVICE), t)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        pg.packed_linear(torch.zeros(2, 32, device=DEVICE, dtype=torch.float64), t)
    had = quantized(torch.randn(8, 32), QuantSpec(hadamard=True))
    with pytest.raises(ValueError, match="hadamard=True"):
        pg.packed_linear(torch.zeros(2, 32, device=DEVICE), had)
    empty = pg.packed_linear(torch.zeros(0, 32, device=DEVICE), t)
    assert empty.shape == (0, 8)


def accumulation_bound(a, w, dtype) -> torch.Tensor:
    """|error| <= 2 K u32 (|a| |W|ᵀ) for two float32 sums in different orders, plus one unit of
    the output dtype's rounding of nearly equal float32 values."""
    k = a.shape[1]
    mag = a.float().abs() @ w.float().abs().t()
    ulp = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    return 2 * k * 2.0**-24 * mag + ulp * mag


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_inputs_within_the_accumulation_bound(dtype):
    g = torch.Generator().manual_seed(9)
    n, k = 50, 96
    t = quantized(torch.randn(n, k, generator=g), QuantSpec())
    wq = fp4stack.dequantize(t, dtype)
    for m, cfg in ((1, None), (17, None), (64, None), (5, SMALL["dot-split2"])):
        a = torch.randn(m, k, generator=g).to(DEVICE, dtype)
        got = pg.packed_linear(a, t, config=cfg)  # None: the heuristic's pick
        err = (got.double() - a.double() @ wq.double().t()).abs()
        assert (err <= accumulation_bound(a, wq, dtype).double()).all(), (m, cfg)


def test_configs_the_kernel_gets_wrong_are_refused():
    # A 16-wide K step of a 16-bit tensor-core dot summed wrongly on the H200 (Triton 3.6).
    with pytest.raises(ValueError, match="block_k must be >= 32"):
        pg.GemmConfig(16, 32, 16)
    with pytest.raises(ValueError, match="multiple of 16"):
        pg.GemmConfig(16, 32, 40)
    assert pg.GemmConfig(4, 16, 16, dot=False).block_k == 16


def test_split_k_is_deterministic():
    g = torch.Generator().manual_seed(10)
    t = quantized(torch.randn(33, 128, generator=g), QuantSpec())
    a = torch.randn(5, 128, generator=g).to(DEVICE)
    cfg = pg.GemmConfig(16, 16, 32, split_k=4)
    first = pg.packed_linear(a, t, config=cfg)
    assert torch.equal(bits(first), bits(pg.packed_linear(a, t, config=cfg)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_serial_split_k_equals_the_reduce_kernel(dtype, monkeypatch):
    """The last split of a tile adding the partial sums (one launch) gives the bits of the
    second reduce launch, bias included, and leaves its tile counters at zero."""
    g = torch.Generator().manual_seed(11)
    t = quantized(torch.randn(70, 256, generator=g), QuantSpec())
    a = torch.randn(3, 256, generator=g).to(DEVICE, dtype)
    bias = torch.randn(70, generator=g).to(DEVICE)
    cfg = pg.GemmConfig(16, 16, 32, split_k=4)
    serial = [pg.packed_linear(a, t, bias, config=cfg) for _ in range(3)]
    locks = pg.tile_locks(a.device, 1)
    assert int(locks.count_nonzero()) == 0
    monkeypatch.setattr(pg, "SERIAL_SPLIT_K", False)
    two_launches = pg.packed_linear(a, t, bias, config=cfg)
    for got in serial:
        assert torch.equal(bits(got), bits(two_launches))


@pytest.mark.parametrize("n,k", [(4096, 4096), (8192, 2048), (2048, 2048)])
def test_decode_heuristic_fills_the_sms(n, k):
    dev = torch.device("cpu")  # 132 SMs, as the H200
    for m in (1, 16):
        cfg, split = pg.choose_config(m, n, k, dev)
        programs = -(-m // pg.effective_block_m(cfg, m)) * -(-n // cfg.block_n) * split
        assert programs >= pg.sm_count(dev), (m, n, k, cfg, split)
        assert -(-k // cfg.block_k) >= split  # every split has work
    big, split = pg.choose_config(1024, n, k, dev)
    assert big.block_m >= 64 and split == 1  # no fp32 partials for many rows


def test_column_sq_norms_match_the_dequantized_weight():
    g = torch.Generator().manual_seed(11)
    t = quantized(torch.randn(70, 40, generator=g), QuantSpec())
    for dtype in (torch.float32, torch.bfloat16):
        want = fp4stack.dequantize(t, dtype).float().pow(2).sum(0)
        torch.testing.assert_close(pg.column_sq_norms(t, dtype), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("spec", [QuantSpec(), QuantSpec(four_over_six=True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_fake_quantize_is_fake_quantize_per_group(spec, dtype):
    g = torch.Generator().manual_seed(12)
    x = (torch.randn(6, 40, generator=g) * torch.logspace(-3, 2, 6)[:, None]).to(dtype)
    groups = torch.tensor([2, 0, 2, 1, 0, 2, 2, 1, 0, 0, 1, 2])  # row r reads x[r // 2]
    amax = torch.tensor([3.0, 0.01, 500.0])
    got = pg.rows_fake_quantize(x.to(DEVICE), 2, amax.to(DEVICE), groups.to(DEVICE), spec,
                                torch.bfloat16).cpu()
    for r, grp in enumerate(groups.tolist()):
        want = reference.fake_quantize(x[r // 2 : r // 2 + 1], spec, amax=amax[grp],
                                       dtype=torch.bfloat16)
        assert torch.equal(bits(got[r : r + 1]), bits(want)), r
    with pytest.raises(ValueError, match="not supported"):
        pg.rows_fake_quantize(x, 1, amax, groups, QuantSpec(rounding="stochastic"), dtype)


# ---- QuantLinear's fused inference path ------------------------------------------------------


def packed_layer(name: str, k=64, n=40, bias=True, dtype=torch.float32, seed=0) -> QuantLinear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias).to(dtype)
    return QuantLinear.from_linear(lin, recipe(name)).to(DEVICE)


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """Let CPU tensors take the fused path (the kernels run under the interpreter)."""
    monkeypatch.setattr(operands_mod, "_FUSED_ON_CPU", True)


@pytest.fixture
def spy(monkeypatch):
    calls = []
    real = linear_mod.quantized_inference_linear

    def wrapped(x2, layer):
        calls.append(layer)
        return real(x2, layer)

    monkeypatch.setattr(linear_mod, "quantized_inference_linear", wrapped)
    return calls


def test_fused_path_taken_only_when_it_should(spy, monkeypatch):
    layer = packed_layer("w4a4")
    x = torch.randn(3, 64, device=DEVICE)
    with torch.no_grad():
        layer(x)
    assert len(spy) == (1 if CUDA else 0)  # CPU tensors keep the reference path
    monkeypatch.setattr(operands_mod, "_FUSED_ON_CPU", True)
    spy.clear()
    with torch.no_grad():
        layer(x)
    assert len(spy) == 1
    layer(x)  # grad mode on and the bias requires grad: the reference path
    assert len(spy) == 1
    layer.bias.requires_grad_(False)
    layer(x)  # grad mode on, but nothing needs a gradient
    assert len(spy) == 2
    layer(x.requires_grad_())
    assert len(spy) == 2  # x needs a gradient
    master = QuantLinear(64, 40, recipe="w4a4").to(DEVICE)
    with torch.no_grad():
        master(x)
        assert len(spy) == 2  # a master weight: the trainer's path
        layer.start_calibration()
        layer(x)
        layer.finish_calibration()
        assert len(spy) == 2  # calibration records on the reference path
    assert not linear_mod.fused_inference_ok(x.detach().double(), layer)  # no float64 kernel


@pytest.mark.parametrize("name", ["w4a4", "w4a4@weights", "w4a4-rc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_matches_reference_path(fused_on_cpu, name, dtype):
    layer = packed_layer(name, dtype=dtype)
    x = torch.randn(2, 5, 64, device=DEVICE, dtype=dtype) * 3
    with torch.no_grad():
        got = layer(x)
        want = layer._reference_forward(x.reshape(-1, 64)).reshape(2, 5, 40)
    assert got.dtype == want.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_fused_layer_static_amax_and_channels(fused_on_cpu):
    r = recipe("w4a4-rc").with_(name="static-rc", activation_amax="static")
    r = r.with_(compensation=replace(r.compensation, mode="static", k=8))
    torch.manual_seed(1)
    layer = QuantLinear.from_linear(torch.nn.Linear(64, 40), r).to(DEVICE)
    x = torch.randn(7, 64, device=DEVICE)
    layer.start_calibration()
    with torch.no_grad():
        layer(x * 2)
    layer.finish_calibration()
    assert layer.rc_channels.numel() == 8
    with torch.no_grad():
        got = layer(x)
        want = layer._reference_forward(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compensated_single_gemm_equals_reference(fused_on_cpu):
    layer = packed_layer("w4a4-rc", bias=False, k=96, n=24, seed=2)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 96, generator=g) * torch.linspace(0.1, 4, 96)).to(DEVICE)
    qw = layer.quantized_weight(torch.float32)
    k = layer.recipe.compensation.count(96)
    with torch.no_grad():
        got = linear_mod.quantized_inference_linear(x, layer)
        # The reference's own choice of channels, and the reference's forward.
        qx = fp4stack.fake_quantize(x, spec=layer.recipe.x)
        chosen = fp4stack.nn.compensation.top_channels(x - qx, qw, k)
        norms = layer.qweight_column_sq_norms(torch.float32)
        energy = (x - qx).pow(2).sum(0) * norms
        assert torch.equal(torch.nonzero(top_mask(energy, k)).squeeze(1), chosen)
        want = linear_mod._compensated(x, None, None, layer.recipe, qw, None, None, None, None)
    bound = accumulation_bound(x.abs() + qx.abs(), qw, torch.float32) * 2
    assert ((got - want).abs() <= bound).all()
    # Every channel compensated: x Q(W)ᵀ, the W4A16 result.
    full = layer.recipe.with_(compensation=replace(layer.recipe.compensation, k=1.0))
    layer.recipe = full
    with torch.no_grad():
        got = linear_mod.quantized_inference_linear(x, layer)
    w4a16 = x @ qw.t()
    assert ((got - w4a16).abs() <= accumulation_bound(x, qw, torch.float32)).all()


def test_column_norms_cached_until_the_weight_changes(fused_on_cpu, monkeypatch):
    layer = packed_layer("w4a4-rc")
    calls = []
    real = pg.column_sq_norms
    monkeypatch.setattr(pg, "column_sq_norms", lambda w, d: calls.append(d) or real(w, d))
    first = layer.qweight_column_sq_norms(torch.float32)
    before = first.clone()
    assert layer.qweight_column_sq_norms(torch.float32) is first and len(calls) == 1
    other = packed_layer("w4a4-rc", seed=5)
    layer.write_packed("weight", [other.packed_weight])  # a weight sync, in place
    layer.refresh_inference_cache()  # what a rollout engine's sync does next
    assert len(calls) == 2
    # Recomputed into the same tensor: a CUDA graph that captured it reads the new norms.
    again = layer.qweight_column_sq_norms(torch.float32)
    assert again is first and len(calls) == 2 and not torch.equal(again, before)
    torch.testing.assert_close(again, other.qweight_column_sq_norms(torch.float32))


@gpu
def test_fused_layers_never_sync_and_capture_in_a_cuda_graph():
    layers = [packed_layer(name, k=256, n=512, dtype=torch.bfloat16) for name in
              ("w4a4", "w4a4-rc", "w4a4@weights")]
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = [layer(x) for layer in layers]  # warm up: compiles, fills the norms cache
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            [layer(x) for layer in layers]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [layer(x) for layer in layers]
    graph.replay()
    torch.cuda.synchronize()
    for got, ref in zip(outs, want, strict=True):
        assert torch.equal(got, ref)


@gpu
@pytest.mark.parametrize("m", [1, 16, 256])
def test_large_shapes_on_gpu(m):
    g = torch.Generator().manual_seed(m)
    t = quantized(torch.randn(4096, 4096, generator=g), QuantSpec())
    a = torch.randn(m, 4096, generator=g).to("cuda", torch.bfloat16)
    got = pg.packed_linear(a, t)
    wq = fp4stack.dequantize(t, torch.bfloat16)
    err = (got.double() - a.double() @ wq.double().t()).abs()
    assert (err <= accumulation_bound(a, wq, torch.bfloat16).double()).all()
    assert torch.equal(got, pg.packed_linear(a, t))  # deterministic


def test_kernels_compile_for_sm90():
    """The table's kernels compile for the H200 (the interpreter compiles nothing)."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_packed_gemm.py"),
                        "--compile-check", "--quick"], capture_output=True, text=True, env=env,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert len(lines) >= 6 and all("bytes spilled" in ln or "SASS" in ln or "wgmma" in ln
                                   for ln in lines), lines
