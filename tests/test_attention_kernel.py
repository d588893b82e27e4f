"""The Triton NVFP4 attention kernels (forward and backward) against the torch reference.

The prologue's Q̂, K̂, V̂ and the backward's quantized dS tiles equal fp4stack.fake_quantize bit
for bit; outputs, lse and gradients equal fp4_attention's torch reference within the order of the
sums. Measured on CPU with fp32 inputs over the cases below: output max abs error 7.2e-7 (max rel
2.6e-5 where |ref| > 1e-2), lse 7.2e-7, dq/dk/dv 9.5e-7; 16-bit inputs: see
test_backward_16bit. The ablations AttentionQuant(reuse=False) and AttentionQuant(ds=None) (fp32
dq/dk/dv within 1.8e-6): see the tests from test_backward_operands_bit_exact on. On CPU the
kernels run under the Triton interpreter at small sizes with 16 x 16 tiles, so that several
query and key tiles and the tails are exercised; on a GPU every test runs on CUDA tensors, and
the @gpu tests add large shapes with the CUDA tiles (all passed on an H200, 2026-11-30).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import fields, replace

import pytest
import torch
import torch.nn.functional as F

import fp4stack.nn.attention as attention
import fp4stack.nn.attention_ablation as ablation_ops
import fp4stack.nn.attention_kernels as attention_kernels
from fp4stack import fake_quantize
from fp4stack.formats.spec import QuantSpec
from fp4stack.nn.attention import NVFP4_RNE, AttentionQuant, fp4_attention
from fp4stack.nn.attention_ablation import AttentionAblation
from fp4stack.nn.attention_quant import NVFP4_SR, NVFP4_TILES

pytest.importorskip("triton")
from fp4stack.kernels import attention as fwd_kernels  # noqa: E402
from fp4stack.kernels import attention_units as units_kernels  # noqa: E402
from fp4stack.kernels.attention import (  # noqa: E402
    Tile,
    fp4_attention_forward,
    quantized_operands,
)
from fp4stack.kernels.attention_bwd import backward_units  # noqa: E402

# An AttentionQuant with the ablation's fields written flat, e.g. ablated(reuse=("v",)).
ablated = AttentionAblation.quant

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
# fp32 inputs: only the order of the sums differs from the reference (measured <= 7.2e-7).
FP32_TOL = dict(atol=2e-6, rtol=1e-5)


@pytest.fixture(autouse=True)
def _quiet_numpy():
    # The interpreter runs on numpy: an all-zero padding block divides by a zero scale, which
    # the kernel then clamps (as the reference does); numpy warns about it all the same.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def draw(B, H, S, L, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, d, generator=g) for n in (S, L, L))
    return [t.to(DEVICE, dtype) for t in (q, k, v)]


def fq_along(x: torch.Tensor, dim: int, amax) -> torch.Tensor:
    """fake_quantize in 1x16 blocks along `dim`, zero-padded to whole blocks, with `amax`."""
    y = x.float().movedim(dim, -1)
    n = y.shape[-1]
    y = F.pad(y, (0, -n % 16))
    y = fake_quantize(y.contiguous(), spec=NVFP4_RNE, amax=amax)
    return y[..., :n].movedim(-1, dim)


def reference_scores(q, k, causal, amaxes):
    """The reference's scaled scores: quantized Q̂ K̂ᵀ / sqrt(d), fp32, -inf where masked."""
    qh, kh = fq_along(q, -1, amaxes[0]), fq_along(k, -1, amaxes[1])
    s = (qh @ kh.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        S, L = s.shape[-2:]
        allowed = torch.ones(S, L, dtype=torch.bool, device=s.device).tril(L - S)
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def reference_lse(q, k, v, causal, amaxes):
    """log-sum-exp of the reference's scaled scores."""
    return torch.logsumexp(reference_scores(q, k, causal, amaxes), dim=-1)


def amaxes_of(*ts):
    return [t.float().abs().amax() for t in ts]


@pytest.mark.parametrize("S, L, d, block_n", [(17, 17, 16, 16), (33, 40, 64, 32),
                                              (5, 33, 16, 64)])
def test_tiles_bit_exact(S, L, d, block_n):
    q, k, v = draw(2, 2, S, L, d, seed=1)
    k[0, 1, 3, :] *= 50  # a block max far from the others
    qa, ka, va = amaxes_of(q, k, v)
    va = va * 3  # a caller's amax that is not this tensor's own is used as given
    qh, kh, vh = quantized_operands(q, k, v, q_amax=qa, k_amax=ka, v_amax=va,
                                    tiles=dict(quant=Tile(block_n, 16)))
    assert torch.equal(qh, fq_along(q, -1, qa))
    assert torch.equal(kh, fq_along(k, -1, ka))
    assert torch.equal(vh, fq_along(v, -2, va))  # blocks of 16 keys, the tail zero-padded


def test_tiles_causal_visited_bit_exact():
    # Causal programs skip key tiles above the diagonal; those they visit hold the same values.
    q, k, v = draw(1, 2, 20, 37, 16, seed=2)
    _, kh, vh = quantized_operands(q, k, v)
    seen = ~torch.isnan(kh)
    assert seen.any()
    assert torch.equal(kh[seen], fq_along(k, -1, k.abs().amax())[seen])
    assert torch.equal(vh[seen], fq_along(v, -2, v.abs().amax())[seen])


CASES = [(17, 17), (33, 33), (5, 33), (1, 17), (16, 16)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("S, L", CASES)
@pytest.mark.parametrize("d", [16, 64])
def test_forward_matches_reference(S, L, d, causal):
    q, k, v = draw(2, 2, S, L, d, seed=S * 100 + L + d)
    amaxes = amaxes_of(q, k, v)
    out, lse = fp4_attention_forward(q, k, v, causal, q_amax=amaxes[0], k_amax=amaxes[1],
                                     v_amax=amaxes[2])
    want = fp4_attention(q, k, v, causal, AttentionQuant.paper())
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == (2, 2, S)
    torch.testing.assert_close(out, want, **FP32_TOL)
    torch.testing.assert_close(lse, reference_lse(q, k, v, causal, amaxes), **FP32_TOL)


def test_amax_default_and_scale():
    q, k, v = draw(1, 2, 17, 17, 32, seed=3)
    out, _ = fp4_attention_forward(q, k, v, False, scale=0.3)
    want = fp4_attention(q, k, v, False, AttentionQuant.paper(), scale=0.3)
    torch.testing.assert_close(out, want, **FP32_TOL)


def test_bf16_small():
    # 16-bit inputs: P goes into the PV dot as bf16 and the output is bf16 (measured 5.3e-3).
    q, k, v = draw(1, 2, 17, 33, 32, dtype=torch.bfloat16, seed=5)
    out, lse = fp4_attention_forward(q, k, v, True)
    want = fp4_attention(q.float(), k.float(), v.float(), True, AttentionQuant.paper())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, reference_lse(q, k, v, True, amaxes_of(q, k, v)),
                               **FP32_TOL)


def test_rejects_bad_shapes():
    q, k, v = draw(1, 2, 8, 8, 16)
    with pytest.raises(ValueError):
        fp4_attention_forward(q[..., :8], k[..., :8], v[..., :8])
    with pytest.raises(ValueError):
        fp4_attention_forward(q, k[:, [0, 1, 1]], v[:, [0, 1, 1]])  # 3 K/V heads for 2 q heads
    with pytest.raises(ValueError):
        fp4_attention_forward(q, k[:, :, :4], v[:, :, :4], causal=True)  # S > L


# ---- the backward ---------------------------------------------------------------------------
def grads(q, k, v, do, causal, backend, **kw):
    """fp4_attention's (out, dq, dk, dv) for output gradient do."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fp4_attention(q, k, v, causal, backend=backend, **kw)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def assert_grads_close(got, want, **tol):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, **tol, msg=lambda m, n=name: f"{n}: {m}")


# fp32 inputs: dq, dk, dv differ from the reference by summation order (and P, dP, dS by the
# order in which the global scales are applied); measured max abs error 9.5e-7 over the cases
# below (out 7.2e-7; |grad| up to ~3.8). A dS element on an E2M1 rounding boundary could round
# the other way in one and not the other; none did here, and the bound below would not hide a
# wrong block (quantizing dS along the wrong axis, or an amax 1e-4 off, fails every case).
GRAD_TOL = dict(atol=4e-6, rtol=1e-5)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("S, L, d", [(17, 17, 16), (33, 40, 32), (5, 33, 16), (1, 17, 64),
                                     (32, 32, 16)])
def test_backward_matches_reference(S, L, d, causal, deterministic, monkeypatch):
    """Triton forward + backward against the torch reference, fp32 inputs (see GRAD_TOL)."""
    monkeypatch.setattr("fp4stack.kernels.attention_bwd.DETERMINISTIC", deterministic)
    q, k, v = draw(2, 2, S, L, d, seed=S * 7 + L + d)
    do = draw(2, 2, S, 1, d, seed=S + 1)[0]
    got = grads(q, k, v, do, causal, "triton")
    want = grads(q, k, v, do, causal, "torch")
    assert_grads_close(got, want, **GRAD_TOL)


def reference_ds(q, k, v, do, causal, amaxes):
    """The reference's dS = P ∘ (dO V̂ᵀ - rowsum(dO ∘ O)), fp32."""
    vh = fq_along(v, -2, amaxes[2])
    p = reference_scores(q, k, causal, amaxes).softmax(-1)
    o = p @ vh
    return p * (do @ vh.transpose(-2, -1) - (do * o).sum(-1, keepdim=True))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal, S, L", [(True, 33, 40), (False, 20, 37), (True, 16, 16)])
def test_ds_amax_and_quantized_tiles(causal, S, L, deterministic):
    """The dS amax is the reference's to fp32 rounding (the kernels' dS differs from the
    reference's by rounding: measured max abs 2.4e-6 at |dS| up to 4.1, amax off by 1-2 ulps);
    the quantized dS tiles equal fake_quantize
    of the kernel's own dS bit for bit, along the queries for dK and along the keys for dQ."""
    q, k, v = draw(1, 2, S, L, 32, seed=11)
    do = draw(1, 2, S, 1, 32, seed=12)[0]
    amax = fwd_kernels.amaxes(q, k, v)
    tiles = fwd_kernels.tiles_for(q, None)
    units = units_kernels.quantize_operands(q, k, v, amax, tiles["quant"])
    out, lse = fwd_kernels.forward_units(*units, amax, causal, 1 / math.sqrt(32), tiles["fwd"])
    *_, ds_amax, dbg = backward_units(do, *units, out, lse, amax, causal, 1 / math.sqrt(32),
                                      tiles, deterministic=deterministic, debug=True)
    want = reference_ds(q, k, v, do, causal, amax)
    torch.testing.assert_close(ds_amax, want.abs().amax(), atol=0, rtol=2e-6)
    for raw, quant, dim in ((dbg[0], dbg[1], -2), (dbg[2], dbg[3], -1)):
        seen = ~torch.isnan(raw)
        assert seen.any() and torch.equal(seen, ~torch.isnan(quant))
        # Skipped tiles are whole 16-blocks along `dim` with dS = 0 in the reference.
        assert (want[~seen] == 0).all()
        torch.testing.assert_close(raw[seen], want[seen], atol=1e-6, rtol=1e-5)
        fq = fq_along(torch.where(seen, raw, 0.0), dim, ds_amax)
        assert torch.equal(quant[seen], fq[seen])


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("H, Hkv", [(4, 2), (3, 1)])
def test_backward_gqa_and_scale(H, Hkv, deterministic, monkeypatch):
    """GQA indexed in-kernel (dK, dV summed over a K/V head's query heads in one program)
    against the reference's repeated heads."""
    monkeypatch.setattr("fp4stack.kernels.attention_bwd.DETERMINISTIC", deterministic)
    q, k, v = draw(1, H, 17, 21, 32, seed=13)
    k, v = k[:, :Hkv], v[:, :Hkv]
    do = draw(1, H, 17, 1, 32, seed=14)[0]
    for causal in (True, False):
        got = grads(q, k, v, do, causal, "triton", scale=0.3)
        assert_grads_close(got, grads(q, k, v, do, causal, "torch", scale=0.3), **GRAD_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_16bit(dtype):
    """16-bit inputs against the reference on the same 16-bit values in fp32: P enters its dots
    in the input dtype, the outputs are rounded to it, and delta = rowsum(dO ∘ O) uses the
    rounded O (as flash attention does; the reference keeps O in fp32). That moves dS and its
    global amax (fp16: 3.38579 vs 3.38593), hence some E4M3 block scales and E2M1 values of dŜ:
    the kernel's dŜ still equals fake_quantize of its own dS bit for bit, but not the
    reference's. Measured max abs error / relative Frobenius error: bf16 dq 9.6e-2 / 1.8e-2,
    dk 8.2e-2 / 1.4e-2, dv 2.1e-2 / 5.9e-3, out 8.9e-3 / 4.7e-3; fp16 dk 1.3e-1 / 1.8e-2, the
    rest <= 1.2e-3 / 3e-4 (|grad| up to ~3.6). On an H200 the bf16 dq's max abs error was 0.174
    (the tensor cores round P and accumulate in another order: other flips)."""
    q, k, v = draw(1, 4, 17, 21, 32, seed=13)
    k, v = k[:, :2], v[:, :2]
    do = draw(1, 4, 17, 1, 32, seed=14)[0]
    lo = [t.to(dtype) for t in (q, k, v, do)]
    got = grads(*lo, True, "triton")
    want = grads(*[t.float() for t in lo], True, "torch")
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == dtype, name
        err = (a.float() - b).abs()
        assert err.max() < 0.3, name
        assert err.norm() / b.norm() < REL_BF16, name


REL_BF16 = 3e-2  # measured at most 1.8e-2 (test_backward_16bit)
FLIP_ROWS = 0.02  # share of gradient rows a rounding flip of dS may move (test_gpu_backward_large)


def test_backend_choice():
    q, k, v = draw(1, 2, 8, 8, 16)
    with pytest.raises(ValueError, match="backend"):
        fp4_attention(q, k, v, backend="cuda")
    with pytest.raises(ValueError, match="mask"):
        fp4_attention(q, k, v, mask=torch.ones(8, 8, dtype=torch.bool), backend="triton")
    with pytest.raises(ValueError, match="method.s specs .* any reuse and ds=None, and Q, K, V in"):
        fp4_attention(q, k, v, config=AttentionQuant.only("q"), backend="triton")
    with pytest.raises(ValueError, match="head_dim"):
        fp4_attention(q[..., :8], k[..., :8], v[..., :8], backend="triton")
    # "auto" runs the kernels on CUDA tensors only: the torch reference on CPU ones, even under
    # the interpreter.
    called = []
    real = attention_kernels.TritonAttentionFn.apply
    attention_kernels.TritonAttentionFn.apply = lambda *a: called.append(1) or real(*a)
    try:
        fp4_attention(q, k, v)
        assert bool(called) == CUDA
        fp4_attention(q, k, v, config=AttentionQuant.off())  # an ablation: always torch
        assert len(called) == int(CUDA)
        fp4_attention(q, k, v, backend="triton")
        assert called
    finally:
        attention_kernels.TritonAttentionFn.apply = real


@pytest.mark.parametrize("cfg", [AttentionQuant.paper(), AttentionQuant(reuse=False),
                                 ablated(rotate_qk=True), AttentionQuant.qk_ds(),
                                 AttentionQuant.qk_ds(reuse=False)],
                         ids=["paper", "noreuse", "rotated", "qk_ds", "qk_ds-noreuse"])
def test_gpt_trains_through_the_kernels(cfg):
    # The path the fullstack recipes take on a GPU (each block's attend hook -> the kernels; GQA
    # with 4 query heads on 2 K/V heads, head_dim 16, a length off the 16-grid), on DEVICE: the
    # same loss and gradients as through the torch reference, to the kernels' summation order.
    import copy

    from fp4stack.models import GPT, GPTConfig
    from fp4stack.nn.attention import use_fp4_attention

    torch.manual_seed(0)
    base = GPT(GPTConfig.tiny(max_seq_len=32)).to(DEVICE)
    idx = torch.randint(0, 256, (2, 24), device=DEVICE)
    runs = {}
    for backend in ("torch", "triton"):
        model = use_fp4_attention(copy.deepcopy(base), cfg, backend=backend)
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        runs[backend] = loss.detach(), [p.grad for p in model.parameters()]
    (loss_ref, grads_ref), (loss_k, grads_k) = runs["torch"], runs["triton"]
    torch.testing.assert_close(loss_k, loss_ref, atol=1e-6, rtol=1e-6)
    for a, b in zip(grads_k, grads_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="backend"):
        use_fp4_attention(base, cfg, backend="cuda")


# ---- the ablations: AttentionQuant(reuse=False) and AttentionQuant(ds=None) -------------------
NOREUSE, DS_HP = AttentionQuant(reuse=False), AttentionQuant(ds=None)
BOTH = AttentionQuant(reuse=False, ds=None)
# Partial reuse: the forward's V̂ in dP only; the forward's Q̂ and K̂ in dK and dQ only.
REUSE_V, REUSE_QK = ablated(reuse=("v",)), ablated(reuse=("q", "k"))
# The backward on the unquantized tensors it does not reuse (all of them; all but V̂).
HP_BWD = ablated(reuse=False, requantize=False)
HP_BWD_V = ablated(reuse=("v",), requantize=False)
# Re-blocked reuse: the forward's values quantized again along each backward GEMM's reduction
# dim (all reused; V̂ only; Q̂, K̂ only with V unquantized in the backward).
REBLOCK = ablated(reblock=True)
REBLOCK_V = ablated(reuse=("v",), reblock=True)
REBLOCK_QK_HP = ablated(reuse=("q", "k"), requantize=False, reblock=True)
# delta = rowsum(P ∘ dP) from the backward's own dP (a sweep of its own in the first pass):
# without reuse, with dS in high precision too (that pass then only sums), and with reuse.
NOREUSE_DELTA = ablated(reuse=False, delta="dp")
BOTH_DELTA = ablated(reuse=False, ds=None, delta="dp")
REUSE_DELTA = ablated(delta="dp")
ABLATIONS = dict(noreuse=NOREUSE, ds_hp=DS_HP, reuse_v=REUSE_V, reuse_qk=REUSE_QK,
                 hp_bwd=HP_BWD, hp_bwd_v=HP_BWD_V, reblock=REBLOCK, reblock_v=REBLOCK_V,
                 reblock_qk_hp=REBLOCK_QK_HP, noreuse_delta=NOREUSE_DELTA,
                 both_delta=BOTH_DELTA, reuse_delta=REUSE_DELTA)


def test_backward_operands_bit_exact():
    """reuse=False's units: Q̂, K̂, V̂ along d, Q̂ along the queries and K̂ along the keys, each
    with its tensor's one global amax, equal the reference's quantize_along bit for bit."""
    q, k, v = draw(2, 2, 21, 37, 32, seed=21)
    amax = fwd_kernels.amaxes(q, k, v)
    tile = fwd_kernels.tiles_for(q, None)["quant"]
    units = units_kernels.backward_operands(q, k, v, amax, tile)
    dec = amax * (1.0 / (units_kernels.SCALE_MAX * 6.0))
    want = [(q, 0, -1), (k, 1, -1), (v, 2, -1), (q, 0, -2), (k, 1, -2)]
    for u, (t, i, dim) in zip(units, want, strict=True):
        assert torch.equal(u * dec[i], fq_along(t, dim, amax[i]))
    # Partial reuse: the reused names' saved units are passed through as they are.
    fwd = units_kernels.quantize_operands(q, k, v, amax, tile)
    assert all(torch.equal(a, b) for a, b in zip(
        ablation_ops.requantized_operands(q, k, v, amax, tile), units, strict=True))
    got = ablation_ops.requantized_operands(fwd[0], k, fwd[2], amax, tile, ("q", "v"))
    assert got[0] is fwd[0] and got[3] is fwd[0] and got[2] is fwd[2]
    assert torch.equal(got[1], units[1]) and torch.equal(got[4], units[4])


def test_reblocked_operands_bit_exact():
    """reblock's units: the forward's V̂ (along keys) again along d, Q̂ and K̂ (along d) again
    along the queries and keys, each at its tensor's forward amax, equal the reference's second
    quantize_along of the forward's values bit for bit; names not reused pass through."""
    q, k, v = draw(2, 2, 21, 37, 32, seed=29)
    amax = fwd_kernels.amaxes(q, k, v)
    tile = fwd_kernels.tiles_for(q, None)["quant"]
    qu, ku, vu = units_kernels.quantize_operands(q, k, v, amax, tile)
    got = ablation_ops.reblocked_operands(vu, qu, ku, amax, tile, ("q", "k", "v"))
    dec = amax * (1.0 / (units_kernels.SCALE_MAX * 6.0))
    want = [(fq_along(v, -2, amax[2]), 2, -1), (fq_along(q, -1, amax[0]), 0, -2),
            (fq_along(k, -1, amax[1]), 1, -2)]
    for u, (hat, i, dim) in zip(got, want, strict=True):
        again = fq_along(hat, dim, amax[i])
        assert torch.equal(u * dec[i], again) and not torch.equal(again, hat)
    partial = ablation_ops.reblocked_operands(vu, qu, ku, amax, tile, ("v",))
    assert partial[1] is qu and partial[2] is ku and torch.equal(partial[0], got[0])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("S, L, d, deterministic", [(17, 21, 16, False), (33, 33, 32, True)])
@pytest.mark.parametrize("name", ABLATIONS)
def test_ablation_backward_matches_reference(name, S, L, d, deterministic, causal, monkeypatch):
    """The kernels with reuse=False or ds=None against the reference with the same config, fp32
    inputs: as for the default config only the order of the sums differs (ds=None's raw dS enters
    fp32 dots unrounded; the reference's stays fp32 too). Measured max abs error over these cases
    (|grad| up to 4.6): noreuse out 7.2e-7, dq 1.4e-6, dk 1.7e-6, dv 1.1e-6; ds_hp out 7.2e-7,
    dq 1.8e-6, dk 1.7e-6, dv 1.1e-6: within GRAD_TOL. Atomic and deterministic dQ paths, an odd
    length (17 queries, 21 keys) and whole tiles (33 = 2 tiles + 1)."""
    monkeypatch.setattr("fp4stack.kernels.attention_bwd.DETERMINISTIC", deterministic)
    cfg = ABLATIONS[name]
    q, k, v = draw(1, 2, S, L, d, seed=S * 3 + L + d)
    do = draw(1, 2, S, 1, d, seed=S + 2)[0]
    got = grads(q, k, v, do, causal, "triton", config=cfg)
    assert_grads_close(got, grads(q, k, v, do, causal, "torch", config=cfg), **GRAD_TOL)


@pytest.mark.parametrize("cfg", [NOREUSE, DS_HP, BOTH, HP_BWD_V, REBLOCK, NOREUSE_DELTA],
                         ids=["noreuse", "ds_hp", "both", "hp_bwd_v", "reblock",
                              "noreuse_delta"])
def test_ablation_gqa(cfg):
    """GQA through fp4_attention (K/V heads indexed in-kernel; the reference quantizes them
    per K/V head and repeats them), causal, with a scale. Measured max abs error over the three
    configs: 8.1e-7."""
    q, k, v = draw(1, 4, 17, 21, 16, seed=23)
    k, v = k[:, :2], v[:, :2]
    do = draw(1, 4, 17, 1, 16, seed=24)[0]
    got = grads(q, k, v, do, True, "triton", config=cfg, scale=0.3)
    assert_grads_close(got, grads(q, k, v, do, True, "torch", config=cfg, scale=0.3), **GRAD_TOL)


def test_noreuse_uses_its_own_units():
    """reuse=False multiplies dP, dQ, dK by V̂ along d, K̂ along keys, Q̂ along queries: its
    dq, dk move away from the reuse=True kernel's far beyond the tolerance (measured max |diff|
    0.26 for both, 22% relative Frobenius; the reference moves alike) while matching the
    reference's reuse=False (3.6e-7); dv (Pᵀ dO, P identical) and the output do not change."""
    q, k, v = draw(1, 2, 17, 33, 16, seed=25)
    do = draw(1, 2, 17, 1, 16, seed=26)[0]
    reuse = grads(q, k, v, do, False, "triton")
    noreuse = grads(q, k, v, do, False, "triton", config=NOREUSE)
    assert_grads_close(noreuse, grads(q, k, v, do, False, "torch", config=NOREUSE), **GRAD_TOL)
    assert torch.equal(noreuse[0], reuse[0]) and torch.equal(noreuse[3], reuse[3])
    for a, b in zip(noreuse[1:3], reuse[1:3], strict=True):
        assert (a - b).abs().max() > 1e-2


def test_ds_hp_debug_operands():
    """ds=None: no dS amax (None), and the dK and dQ dots take the kernel's raw dS as it is
    (fp32 inputs: no rounding), which matches the reference's dS."""
    q, k, v = draw(1, 2, 20, 37, 16, seed=27)
    do = draw(1, 2, 20, 1, 16, seed=28)[0]
    amax = fwd_kernels.amaxes(q, k, v)
    tiles = fwd_kernels.tiles_for(q, None)
    units = units_kernels.quantize_operands(q, k, v, amax, tiles["quant"])
    out, lse = fwd_kernels.forward_units(*units, amax, True, 1 / math.sqrt(16), tiles["fwd"])
    *_, ds_amax, dbg = backward_units(do, *units, out, lse, amax, True, 1 / math.sqrt(16),
                                      tiles, debug=True, quant_ds=False)
    assert ds_amax is None
    want = reference_ds(q, k, v, do, True, amax)
    for raw, used in ((dbg[0], dbg[1]), (dbg[2], dbg[3])):
        seen = ~torch.isnan(raw)
        assert seen.any() and torch.equal(raw[seen], used[seen])
        assert (want[~seen] == 0).all()
        torch.testing.assert_close(raw[seen], want[seen], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("cfg, rel", [(DS_HP, 1e-2), (BOTH, REL_BF16), (HP_BWD, 5e-2),
                                      (REBLOCK, 5e-2)],
                         ids=["ds_hp", "both", "hp_bwd", "reblock"])
def test_ablation_bf16(cfg, rel):
    """bf16 inputs against the reference on the same bf16 values in fp32. ds=None: dS enters its
    dots rounded to bf16 (the reference keeps it fp32), P, O rounded as for the default config;
    no dŜ rounding boundary to cross, so it is closer than the default config (max abs /
    relative Frobenius error: dq 1.0e-2 / 4.3e-3, dk 1.9e-2 / 6.5e-3, dv 2.1e-2 / 5.9e-3, out
    8.9e-3 / 4.7e-3). Both ablations: dq 5.1e-2 / 8.3e-3, dk 6.1e-2 / 1.3e-2 (the default's dŜ
    amax shifts apply); fp16 measured <= 3.6e-2 / 5.7e-3. The backward on the unquantized Q,
    K, V (HP_BWD): dq 2.6e-1 / 3.2e-2, dk 1.3e-1 / 2.2e-2, dv 2.5e-2 / 5.8e-3 (dŜ rounding
    boundaries again). Re-blocked reuse (REBLOCK): dq 1.3e-1 / 2.7e-2, dk 1.5e-1 / 2.8e-2, dv
    2.1e-2 / 5.9e-3, out as the default's. |grad| up to ~3.6."""
    q, k, v = draw(1, 4, 17, 21, 32, seed=13)
    k, v = k[:, :2], v[:, :2]
    do = draw(1, 4, 17, 1, 32, seed=14)[0]
    lo = [t.to(torch.bfloat16) for t in (q, k, v, do)]
    got = grads(*lo, True, "triton", config=cfg)
    want = grads(*[t.float() for t in lo], True, "torch", config=cfg)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == torch.bfloat16, name
        err = (a.float() - b).abs()
        assert err.max() < 0.3, name
        assert err.norm() / b.norm() < rel, name


# Stochastic rounding: of the forward's Q, K, V (reused, or with fresh draws in the backward),
# or only of the backward's re-quantization (along the forward's dims or the reduction's).
STOCHASTIC = dict(
    sr_qkv=AttentionQuant(q=NVFP4_SR, k=NVFP4_SR, v=NVFP4_SR),
    sr_qkv_noreuse=AttentionQuant(q=NVFP4_SR, k=NVFP4_SR, v=NVFP4_SR, reuse=False),
    sr_k_reuse_v=ablated(k=NVFP4_SR, reuse=("v",), requantize_rounding="rne"),
    fresh_sr=ablated(reuse=False, requantize_along="forward",
                            requantize_rounding="stochastic"),
    noreuse_sr=ablated(reuse=False, requantize_rounding="stochastic", ds=None),
    sr_hp_bwd=ablated(q=NVFP4_SR, v=NVFP4_SR, reuse=False, requantize=False),
)


@pytest.mark.parametrize("axis, dim", [(1, -1), (0, -2)])
@pytest.mark.parametrize("n, seed, dtype", [(21, 12345, torch.float32), (32, 2, torch.float32),
                                            (21, 3, torch.float32), (21, 4, torch.bfloat16)])
def test_stochastic_units_bit_exact(axis, dim, n, seed, dtype):
    """quantize_units with a seed draws what the reference's quantize_along draws for that
    seed, element for element, along d and along the rows (padded to whole blocks); another
    seed draws otherwise, and the rounding is not round-to-nearest. The seeds' two 32-bit keys
    are both >= 2**31, only the first, only the second (the kernel takes them as int32); bf16
    inputs give bf16 units, exact (at most 6 significant bits)."""
    q, k, _ = draw(2, 3, n, 5, 32, dtype=dtype, seed=41)
    amax = fwd_kernels.amaxes(q, k, k)
    tile = fwd_kernels.tiles_for(q, None)["quant"]
    units = units_kernels.quantize_units(q, amax, axis, tile, seed=seed)
    assert units.dtype == dtype
    got = units_kernels.unit_values(units, amax, 0)
    want = attention.quantize_along(q, NVFP4_SR, dim, torch.float32, seed, amax=amax[0])
    assert torch.equal(got, want)
    other = units_kernels.unit_values(
        units_kernels.quantize_units(q, amax, axis, tile, seed=seed + 1), amax, 0)
    assert not torch.equal(other, got) and not torch.equal(got, fq_along(q, dim, amax[0]))


@pytest.mark.parametrize("S, L, d, Hkv", [(17, 21, 16, 2), (33, 33, 32, 1)])
@pytest.mark.parametrize("name", STOCHASTIC)
def test_stochastic_matches_reference(name, S, L, d, Hkv):
    """Stochastic configs through fp4_attention, kernels against the reference after the same
    torch.manual_seed: the seeds are drawn in the same order and each K/V head is quantized
    once (GQA: Hkv of 4 query heads), so every rounding matches and only the order of the sums
    differs (within GRAD_TOL). The draws matter: the gradients move away from the
    round-to-nearest config's."""
    cfg = STOCHASTIC[name]
    q, k, v = draw(1, 4, S, L, d, seed=S + L + d)
    k, v = k[:, :Hkv], v[:, :Hkv]
    do = draw(1, 4, S, 1, d, seed=S + 5)[0]
    torch.manual_seed(7)
    got = grads(q, k, v, do, True, "triton", config=cfg)
    torch.manual_seed(7)
    assert_grads_close(got, grads(q, k, v, do, True, "torch", config=cfg), **GRAD_TOL)
    rounding = None if cfg.ablation is None else replace(cfg.ablation, requantize_rounding=None)
    rne = replace(cfg, **{n: NVFP4_RNE for n in "qkv" if getattr(cfg, n) == NVFP4_SR},
                  ablation=rounding)
    nearest = grads(q, k, v, do, True, "triton", config=rne)
    assert max((a - b).abs().max() for a, b in zip(got[1:], nearest[1:], strict=True)) > 1e-3


@pytest.mark.parametrize("name", ["sr_qkv_noreuse", "fresh_sr"])
def test_stochastic_bf16(name):
    """bf16 inputs, stochastic configs: after the same torch.manual_seed the kernels round as
    the reference does on the same bf16 values (in fp32), so only the bf16 dots and sums
    differ, as for the round-to-nearest ablations (test_ablation_bf16). Measured relative
    Frobenius errors at most 2.2e-2; with the reference drawing other seeds, 0.22-0.39."""
    q, k, v = draw(1, 4, 17, 21, 32, seed=15)
    k, v = k[:, :2], v[:, :2]
    do = draw(1, 4, 17, 1, 32, seed=16)[0]
    lo = [t.to(torch.bfloat16) for t in (q, k, v, do)]
    torch.manual_seed(3)
    got = grads(*lo, True, "triton", config=STOCHASTIC[name])
    torch.manual_seed(3)
    want = grads(*[t.float() for t in lo], True, "torch", config=STOCHASTIC[name])
    for label, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == torch.bfloat16, label
        assert (a.float() - b).norm() / b.norm() < 5e-2, label


def test_triton_configs():
    """triton_unsupported accepts the default config and its ablations (reuse, requantize, ds)
    and V unquantized without an ablation; any other spec or flag stays on the reference, and
    backend="triton" says why."""
    q, k, v = draw(1, 2, 8, 8, 16)
    tiled = [replace(TILED, **kw) for kw in ({}, {"reuse": False}, {"ds": None})]
    rotated = [ablated(rotate_qk=True), ablated(rotate_qk=True, reuse=False)]
    qk_ds = [AttentionQuant.qk_ds(), AttentionQuant.qk_ds(reuse=False),
             AttentionQuant(v=None, ds=None)]  # V unquantized: taken raw by the kernels
    for cfg in (AttentionQuant.paper(), NOREUSE, DS_HP, BOTH, *ABLATIONS.values(), *tiled,
                *rotated, *qk_ds):
        assert attention_kernels.triton_unsupported(q, cfg, None) == "", cfg
    for cfg in STOCHASTIC.values():
        assert attention_kernels.triton_unsupported(q, cfg, None) == "", cfg
    for cfg in (AttentionQuant.only("q"), AttentionQuant(p=NVFP4_RNE),
                AttentionQuant(dp=NVFP4_RNE), replace(rotated[0], v=None),
                AttentionQuant(ds=NVFP4_SR), AttentionQuant(q=QuantSpec(), ds=None),
                AttentionQuant(q=QuantSpec(rounding="stochastic")),
                ablated(q=NVFP4_SR, reblock=True),
                ablated(reuse=("v",), reblock=True, requantize_rounding="stochastic"),
                replace(TILED, reuse=False,
                        ablation=AttentionAblation(requantize_rounding="stochastic")),
                AttentionQuant.off()):
        why = attention_kernels.triton_unsupported(q, cfg, None)
        assert "any reuse and ds=None, and Q, K, V in 16x16 tiles" in why, cfg
        assert cfg.describe() in why, cfg
        with pytest.raises(ValueError, match="fp4_attention.backend='triton'.: the kernels"):
            fp4_attention(q, k, v, config=cfg, backend="triton")
    # kernel_config reads every field: a new AttentionQuant field must be taught to it.
    assert set(attention_kernels.KERNEL_FIELDS) == {f.name for f in fields(AttentionQuant)}


@gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("S, L, d", [(1000, 1000, 128), (257, 1300, 64), (511, 511, 32)])
def test_gpu_bf16_large(S, L, d, causal):
    q, k, v = draw(2, 4, S, L, d, dtype=torch.bfloat16, seed=4)
    qh, kh, vh = quantized_operands(q, k, v)
    qa, ka, va = amaxes_of(q, k, v)
    assert torch.equal(qh, fq_along(q, -1, qa))
    assert torch.equal(kh, fq_along(k, -1, ka))
    assert torch.equal(vh, fq_along(v, -2, va))
    out, lse = fp4_attention_forward(q, k, v, causal, q_amax=qa, k_amax=ka, v_amax=va)
    want = fp4_attention(q.float(), k.float(), v.float(), causal, AttentionQuant.paper())
    # bf16 P in the PV dot and a bf16 output: errors of bf16's 2**-8 relative size.
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, reference_lse(q, k, v, causal, (qa, ka, va)),
                               atol=1e-4, rtol=1e-5)


@gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("S, L, d", [(1000, 1000, 128), (257, 1300, 64), (511, 511, 32)])
def test_gpu_backward_large(S, L, d, causal, deterministic, monkeypatch):
    """Default CUDA tiles, against the reference. The kernel's dS differs from the reference's
    by fp32 rounding (another summation order), so among millions of dS elements a few sit
    within that of an E2M1 or E4M3 rounding boundary and round the other way; each such flip
    moves one row of dQ (or of dK) by ~1e-3. Measured on an H200: up to 0.4% of dq elements
    off the CPU tolerance. So the checks are per row: at most FLIP_ROWS of the rows differ (a
    wrong block axis, scale or amax moves nearly every row) and the relative Frobenius error is
    small; bf16, the relative Frobenius error of the CPU bf16 test."""
    monkeypatch.setattr("fp4stack.kernels.attention_bwd.DETERMINISTIC", deterministic)
    check_large(S, L, d, causal, AttentionQuant.paper())


@gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("S, L, d", [(1000, 1000, 128), (257, 1300, 64)])
def test_gpu_delta_from_dp_large(S, L, d, causal):
    """delta="dp" without reuse (its own sweep for rowsum(P ∘ dP)), checked as the default."""
    check_large(S, L, d, causal, NOREUSE_DELTA)


def check_large(S, L, d, causal, cfg):
    q, k, v = draw(2, 4, S, L, d, seed=6)
    do = draw(2, 4, S, 1, d, seed=7)[0]
    want = grads(q, k, v, do, causal, "torch", config=cfg)
    got = grads(q, k, v, do, causal, "triton", config=cfg)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        rows_off = (~torch.isclose(a, b, atol=2e-5, rtol=1e-4)).any(-1).float().mean()
        rel = (a - b).norm() / b.norm()
        print(f"{name}: rows off {rows_off:.2e}, relative Frobenius error {rel:.2e}")
        assert rows_off <= FLIP_ROWS, name
        assert rel < 1e-2, name
    bf = [t.to(torch.bfloat16) for t in (q, k, v, do)]
    got = grads(*bf, causal, "auto", config=cfg)
    want = grads(*[t.float() for t in bf], causal, "torch", config=cfg)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == torch.bfloat16
        assert (a.float() - b).norm() / b.norm() < REL_BF16, name


# ---- Q, K, V in 16x16 tiles: one quantization for every GEMM -----------------------------------
TILED = AttentionQuant.tiled()


def test_tiled_operands_bit_exact():
    """The tiled prologue's Q̂, K̂, V̂ equal fake_quantize with 16x16 tiles over (tokens, d) bit
    for bit, the token tail zero-padded; a tile's one scale spans 16 rows, so changing one row
    moves its 15 neighbours' values too."""
    q, k, v = draw(2, 2, 21, 37, 32, seed=31)
    k[0, 1, 3, 5] *= 40
    got = quantized_operands(q, k, v, tiled=True, tiles=dict(quant=Tile(32, 16)))
    for t, hat in zip((q, k, v), got, strict=True):
        want = attention.quantize_along(t, NVFP4_TILES, -1, torch.float32)
        assert torch.equal(hat, want)
        assert not torch.equal(hat, fq_along(t, -1, t.abs().amax()))  # not 1x16 blocks


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("S, L, d, deterministic", [(17, 21, 16, False), (33, 33, 32, True)])
@pytest.mark.parametrize("reuse", [True, False])
def test_tiled_backward_matches_reference(S, L, d, deterministic, causal, reuse, monkeypatch):
    """The tiled kernels against the reference of the same config, fp32 inputs; with tiles the
    reference's reuse and no reuse are the same numbers, and the kernels run one path for both."""
    monkeypatch.setattr("fp4stack.kernels.attention_bwd.DETERMINISTIC", deterministic)
    cfg = replace(TILED, reuse=reuse)
    probe = torch.empty(1, 1, 1, d, device=DEVICE)
    assert attention_kernels.triton_unsupported(probe, cfg, None) in (
        "", "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)")
    q, k, v = draw(1, 2, S, L, d, seed=S * 5 + L + d)
    do = draw(1, 2, S, 1, d, seed=S + 3)[0]
    got = grads(q, k, v, do, causal, "triton", config=cfg)
    assert_grads_close(got, grads(q, k, v, do, causal, "torch", config=cfg), **GRAD_TOL)


def test_tiled_gqa_and_the_configs_the_kernels_leave_to_the_reference():
    q, k, v = draw(1, 4, 17, 21, 16, seed=33)
    k, v = k[:, :2], v[:, :2]
    do = draw(1, 4, 17, 1, 16, seed=34)[0]
    got = grads(q, k, v, do, True, "triton", config=TILED, scale=0.3)
    assert_grads_close(got, grads(q, k, v, do, True, "torch", config=TILED, scale=0.3),
                       **GRAD_TOL)
    for cfg in (replace(TILED, ablation=AttentionAblation(reblock=True)),
                replace(TILED, reuse=False, ablation=AttentionAblation(requantize=False)),
                replace(TILED, v=NVFP4_RNE)):
        with pytest.raises(ValueError, match="16x16 tiles"):
            fp4_attention(q, k, v, config=cfg, backend="triton")
