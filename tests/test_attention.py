"""NVFP4 attention: exact when nothing is quantized, equal to an independent fake-quant reference
when it is, tensor reuse really reusing, masking, shapes and dtypes, and the GPT hook."""

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import fp4stack.nn.attention as attention
from fp4stack import QuantSpec, fake_quantize
from fp4stack.formats import hadamard
from fp4stack.models import GPT, GPTConfig
from fp4stack.nn.attention import AttentionQuant, fp4_attention, use_fp4_attention
from fp4stack.nn.attention_ablation import AttentionAblation
from fp4stack.nn.attention_quant import NVFP4_SR

TIGHT = dict(rtol=1e-10, atol=1e-10)
# An AttentionQuant with the ablation's fields written flat, e.g. ablated(reuse=("v",)).
ablated = AttentionAblation.quant


def inputs(B=1, H=2, S=32, L=None, d=32, Hkv=None, dtype=torch.float64, seed=0):
    """q [B, H, S, d], k, v [B, Hkv, L, d] leaf tensors and an output gradient dO."""
    L, Hkv = L or S, Hkv or H
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    q, k, v = draw(B, H, S, d), draw(B, Hkv, L, d), draw(B, Hkv, L, d)
    return [t.requires_grad_() for t in (q, k, v)], draw(B, H, S, d)


def run(qkv, do, **kw):
    """fp4_attention's output and (dq, dk, dv) for output gradient do."""
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv)
    o = fp4_attention(q, k, v, **kw)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def sdpa(qkv, do, mask=None, causal=False):
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def causal_mask(S, L):
    return torch.ones(S, L, dtype=torch.bool).tril(L - S)


# ---- an independent reference: fake_quantize plus the attention formulas, in float64 ----------
def fq(t, dim, amax=None):
    """NVFP4 values of t quantized along `dim` (fp32 quantizer, fake_quantize's own padding),
    with global amax `amax` (default: t's)."""
    x = t.transpose(dim, -1).float().contiguous()
    return fake_quantize(x, spec=QuantSpec(), amax=amax).double().transpose(dim, -1)


def reference(qkv, do, mask, reuse=True, requantize=True, reblock=False):
    """The default config (Q, K, V, dS quantized) written out by hand, float64. reuse: True,
    False or the names of q, k, v whose forward values the backward reuses; the others are
    re-quantized along the backward GEMM's reduction dim, or taken unquantized. reblock: a
    reused value in a GEMM that reduces along another dim than its blocks is quantized again
    along that dim, with the unquantized tensor's amax."""
    reused = "qkv" if reuse is True else "" if reuse is False else reuse
    q, k, v = (t.detach().double() for t in qkv)
    do = do.double()
    scale = 1 / math.sqrt(q.shape[-1])
    qh, kh, vh = fq(q, -1), fq(k, -1), fq(v, -2)
    s = ((qh @ kh.mT) * scale).masked_fill(~mask, float("-inf"))
    p, lse = s.softmax(-1), s.logsumexp(-1, keepdim=True)
    o = p @ vh

    def backward_operand(name, t, hat, dim):
        if name in reused:
            forward_dim = -2 if name == "v" else -1
            return fq(hat, dim, t.float().abs().amax()) if reblock and dim != forward_dim \
                else hat
        return fq(t, dim) if requantize else t

    q_s, k_s = backward_operand("q", q, qh, -1), backward_operand("k", k, kh, -1)
    p = (((q_s @ k_s.mT) * scale).masked_fill(~mask, float("-inf")) - lse).exp()
    dv = p.mT @ do
    dp = do @ backward_operand("v", v, vh, -1).mT
    ds = p * (dp - (do * o).sum(-1, keepdim=True))
    dq = fq(ds, -1) @ backward_operand("k", k, kh, -2) * scale
    dk = fq(ds, -2).mT @ backward_operand("q", q, qh, -2) * scale
    return o, dq, dk, dv


def assert_all_close(got, want, **tol):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, n=name: f"{n}: {m}")


# ---- exactness with every quantizer off ---------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
def test_off_equals_exact_attention(causal):
    qkv, do = inputs(B=2, S=37, d=32)
    got = run(qkv, do, causal=causal, config=AttentionQuant.off())
    assert_all_close(got, sdpa(qkv, do, causal=causal), **TIGHT)


def test_off_decode_gqa_and_scale_match_sdpa():
    qkv, do = inputs(H=4, Hkv=2, S=5, L=21, d=16)
    q, k, v = qkv
    rep = [t.detach().repeat_interleave(2, dim=1) for t in (k, v)]
    want_o, want_dq, dk, dv = sdpa([q, *rep], do, mask=causal_mask(5, 21))
    got = run(qkv, do, config=AttentionQuant.off())
    # GQA: a K/V head's gradient sums its two query heads'.
    want = (want_o, want_dq, dk.unflatten(1, (2, 2)).sum(2), dv.unflatten(1, (2, 2)).sum(2))
    assert_all_close(got, want, **TIGHT)
    o = run(qkv, do, config=AttentionQuant.off(), scale=0.3, causal=False)[0]
    want = F.scaled_dot_product_attention(q.detach(), *rep, scale=0.3)
    torch.testing.assert_close(o, want, **TIGHT)


# ---- the default config against the reference ---------------------------------------------
@pytest.mark.parametrize(("S", "L", "d"), [(1, 1, 16), (17, 17, 32), (33, 33, 64), (32, 32, 16),
                                           (7, 40, 32), (1, 19, 64)])
@pytest.mark.parametrize("reuse, requantize, reblock", [
    (True, True, False), (False, True, False), (("v",), True, False), (("q", "k"), True, False),
    (False, False, False), (("v",), False, False), (True, True, True), (("v",), True, True),
    (("q", "k"), False, True)])
def test_default_matches_fake_quant_reference(S, L, d, reuse, requantize, reblock):
    qkv, do = inputs(S=S, L=L, d=d, seed=S + L + d)
    cfg = ablated(reuse=reuse, requantize=requantize, reblock=reblock)
    got = run(qkv, do, config=cfg)
    want = reference(qkv, do, causal_mask(S, L), reuse, requantize, reblock)
    assert_all_close(got, want, **TIGHT)


def test_reblock_is_a_second_rounding_of_the_forward_values():
    """Re-blocked reuse changes dq and dk against plain reuse and against no reuse (other
    numbers from both), never the output or dv; and it stays closer to plain reuse's dq than no
    reuse does, since it starts from the forward's values."""
    qkv, do = inputs(S=48, d=32, seed=5)
    reuse, reblock, fresh = (run(qkv, do, config=ablated(**kw)) for kw in (
        {}, {"reblock": True}, {"reuse": False}))
    assert torch.equal(reuse[0], reblock[0]) and torch.equal(reuse[3], reblock[3])
    for i in (1, 2):
        assert not torch.allclose(reblock[i], reuse[i], rtol=1e-3)
        assert not torch.allclose(reblock[i], fresh[i], rtol=1e-3)
    assert (reblock[1] - reuse[1]).norm() < (fresh[1] - reuse[1]).norm()


# ---- Q, K, V in 16x16 tiles -----------------------------------------------------------------
def fq_tiles(t):
    """NVFP4 values of t in 16x16 tiles over its last two dims, both zero-padded to 16s."""
    x = t.float()
    rows, cols = x.shape[-2:]
    x = F.pad(x, (0, -cols % 16, 0, -rows % 16)).contiguous()
    return fake_quantize(x, spec=QuantSpec(block=(16, 16)))[..., :rows, :cols].double()


@pytest.mark.parametrize(("S", "L", "d"), [(1, 1, 16), (17, 17, 32), (33, 40, 64), (7, 40, 32)])
@pytest.mark.parametrize("kw", [{}, {"reuse": False}, {"reblock": True}, {"reuse": ("v",)}])
def test_tiles_match_fake_quant_reference(S, L, d, kw):
    """One tiled quantization of each of Q, K, V serves every GEMM of both passes, so reuse, no
    reuse, partial reuse and reblock are all the hand-written reference below (dS in 1x16
    blocks along each GEMM's reduction, as by default)."""
    qkv, do = inputs(S=S, L=L, d=d, seed=S * 3 + L + d)
    tiles = QuantSpec(block=(16, 16), nan_policy="propagate")
    got = run(qkv, do, config=ablated(q=tiles, k=tiles, v=tiles, **kw))
    q, k, v = (t.detach().double() for t in qkv)
    qh, kh, vh = fq_tiles(q), fq_tiles(k), fq_tiles(v)
    scale = 1 / math.sqrt(d)
    p = ((qh @ kh.mT) * scale).masked_fill(~causal_mask(S, L), float("-inf")).softmax(-1)
    o = p @ vh
    ds = p * (do @ vh.mT - (do * o).sum(-1, keepdim=True))
    want = (o, fq(ds, -1) @ kh * scale, fq(ds, -2).mT @ qh * scale, p.mT @ do)
    assert_all_close(got, want, **TIGHT)


def rotated(t):
    """t times the block-diagonal matrix of 16-point random Hadamard transforms, written as a
    matrix product (not the butterflies fp4_attention uses)."""
    m = torch.block_diag(*[hadamard.rht_matrix(torch.float64)] * (t.shape[-1] // 16))
    return t.detach().double() @ m, m


@pytest.mark.parametrize(("S", "L", "d", "Hkv"), [(17, 17, 32, 2), (33, 40, 64, 1)])
@pytest.mark.parametrize("reuse", [True, False])
def test_rotate_qk_is_the_reference_on_rotated_q_and_k(S, L, d, Hkv, reuse):
    """rotate_qk: the default config on (Q R, K R) with R orthogonal; dQ, dK come back by Rᵀ."""
    qkv, do = inputs(S=S, L=L, d=d, H=2, Hkv=Hkv, seed=S + d)
    got = run(qkv, do, config=ablated(rotate_qk=True, reuse=reuse))
    (qr, m), (kr, _) = rotated(qkv[0]), rotated(qkv[1])
    rep = 2 // Hkv
    k, v = (t.detach().repeat_interleave(rep, dim=1) for t in (kr, qkv[2]))
    o, dq, dk, dv = reference((qr, k, v), do, causal_mask(S, L), reuse=reuse)
    dk, dv = (t.unflatten(1, (Hkv, rep)).sum(2) for t in (dk, dv))
    assert_all_close(got, (o, dq @ m.T, dk @ m.T, dv), **TIGHT)
    plain = run(qkv, do, config=AttentionQuant(reuse=reuse))
    assert not torch.equal(got[0], plain[0])  # the rotation changes which values Q̂, K̂ take


def test_rotate_qk_rounds_fewer_values_to_zero():
    """Q with one channel per 16-block 8x the others (as trained models' low RoPE frequencies
    are larger): in blocks along d a fifth of Q rounds to zero; rotated, under a tenth does,
    fewer than for unit Gaussian values. (Against a single far larger outlier the rotation
    cannot help: the small values then sit below the rotated block's step either way.)"""
    q = inputs(S=64, d=64, seed=5)[0][0].detach().clone()
    q[..., ::16] *= 8

    def zero_share(t):
        return (attention.quantize_along(t, attention.NVFP4_RNE, -1, torch.float64) == 0) \
            .double().mean().item()

    assert zero_share(q) > 0.2 and zero_share(rotated(q)[0]) < 0.05


def test_tiles_are_not_blocks():
    """A tile's one scale spans 16 rows: tiles differ from 1x16 blocks along either dim, and
    a tiled Q̂ is the same whichever dim quantize_along is told its blocks run along."""
    q = inputs(S=32, d=32, seed=9)[0][0].detach()
    tiles = QuantSpec(block=(16, 16), nan_policy="propagate")
    along_d = attention.quantize_along(q, tiles, -1, torch.float64)
    assert torch.equal(along_d, attention.quantize_along(q, tiles, -2, torch.float64))
    assert torch.equal(along_d, fq_tiles(q))
    assert not torch.equal(along_d, fq(q, -1)) and not torch.equal(along_d, fq(q, -2))
    with pytest.raises(ValueError, match="last two dims"):
        attention.quantize_along(q, tiles, 1, torch.float64)


def test_padding_mask_matches_reference_and_empty_rows_give_zero():
    qkv, do = inputs(B=2, S=20)
    mask = torch.rand(2, 1, 20, 20, generator=torch.Generator().manual_seed(3)) < 0.6
    mask |= torch.eye(20, dtype=torch.bool)
    got = run(qkv, do, causal=False, mask=mask)
    assert_all_close(got, reference(qkv, do, mask), **TIGHT)
    mask[:, :, 4] = False  # query 4 may read nothing: zeros, as flash attention gives, not NaN
    o, dq, dk, dv = run(qkv, do, causal=False, mask=mask)
    assert all(torch.isfinite(t).all() for t in (o, dq, dk, dv))
    assert (o[:, :, 4] == 0).all() and (dq[:, :, 4] == 0).all()


# ---- tensor reuse --------------------------------------------------------------------------
@pytest.fixture
def spy(monkeypatch):
    """Records (input, spec, seed, amax) of every quantization fp4_attention makes."""
    calls = []
    real = attention.fake_quantize

    def record(x, *, spec, seed=None, amax=None):
        calls.append((x.detach().clone(), spec, seed, amax))
        return real(x, spec=spec, seed=seed, amax=amax)

    monkeypatch.setattr(attention, "fake_quantize", record)
    return calls


def padded(t, dim):  # t with `dim` moved last and zero-padded to whole 16-blocks, fp32
    x = t.detach().transpose(dim, -1).float()
    return F.pad(x, (0, -x.shape[-1] % 16))


def test_reuse_backward_uses_the_forward_values_and_quantizes_only_ds(spy):
    qkv, do = inputs(S=24, d=32, dtype=torch.float32)
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv)
    o = fp4_attention(q, k, v)
    assert [c[0].shape for c in spy] == [padded(q, -1).shape, padded(k, -1).shape,
                                         padded(v, -2).shape]
    forward_calls = len(spy)
    qh, kh, vh = o.grad_fn.saved_tensors[:3]
    for saved, t, dim in ((qh, q, -1), (kh, k, -1), (vh, v, -2)):  # bitwise the forward's
        assert torch.equal(saved, fq(t, dim).float())
    o.backward(do)
    backward = spy[forward_calls:]
    assert len(backward) == 2  # dS along keys (for dQ) and along queries (for dK); nothing else
    assert [c[0].shape for c in backward] == [(1, 2, 24, 32), (1, 2, 24, 32)]
    for x, *_ in backward:
        assert not any(torch.equal(x, padded(t, dim)) for t in (q, k, v) for dim in (-1, -2))


def test_no_reuse_requantizes_along_each_reduction_dim_and_changes_grads(spy):
    qkv, do = inputs(S=24, d=32, dtype=torch.float32)
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv)
    fp4_attention(q, k, v, config=AttentionQuant(reuse=False)).backward(do)
    backward = [x for x, *_ in spy[3:]]
    # q, k along d (the scores), v along d, k along keys, q along queries, dS twice.
    assert len(backward) == 7

    def requantized(t, dim):
        return any(x.shape == padded(t, dim).shape and torch.equal(x, padded(t, dim))
                   for x in backward)

    assert requantized(q, -1) and requantized(k, -1)  # S recomputed from re-quantized Q, K
    assert requantized(v, -1) and requantized(k, -2) and requantized(q, -2)  # the other direction
    reuse = run(qkv, do)
    no_reuse = run(qkv, do, config=AttentionQuant(reuse=False))
    assert torch.equal(reuse[0], no_reuse[0]) and torch.equal(reuse[3], no_reuse[3])
    assert not torch.allclose(reuse[1], no_reuse[1], rtol=1e-3)
    assert not torch.allclose(reuse[2], no_reuse[2], rtol=1e-3)


def test_reuse_recomputes_a_stochastic_p_with_the_forward_seed(spy):
    sr = QuantSpec(rounding="stochastic", nan_policy="propagate")
    qkv, do = inputs(S=16, dtype=torch.float32)
    run(qkv, do, config=AttentionQuant(p=sr))
    p_calls = [c for c in spy if c[1] == sr]
    assert len(p_calls) == 2 and p_calls[0][2] == p_calls[1][2]  # same P, same seed
    assert torch.equal(p_calls[0][0], p_calls[1][0])


def test_no_reuse_recomputes_stochastic_q_k_scores_with_the_forward_seeds(spy):
    """Stochastic Q, K without reuse: S in the backward is the forward's (same seeds, same
    bits), while the operands of dQ and dK are fresh draws along the other dim."""
    sr = QuantSpec(rounding="stochastic", nan_policy="propagate")
    qkv, do = inputs(S=16, dtype=torch.float32)
    run(qkv, do, config=AttentionQuant(q=sr, k=sr, reuse=False))
    forward, backward = spy[:3], spy[3:]
    for fwd in forward[:2]:  # Q and K along d, as S needs them
        again = [c for c in backward if c[0].shape == fwd[0].shape and torch.equal(c[0], fwd[0])]
        assert again and all(c[2] == fwd[2] for c in again)


def test_reuse_of_stochastic_q_k_v_is_attention_on_the_forward_draws():
    """Stochastic Q, K, V with reuse: the output and gradients are exactly those of attention
    on the forward's own draws with only dS quantized, and the next call draws anew."""
    torch.manual_seed(0)  # the stochastic rounding's seeds come from torch's generator
    qkv, do = inputs(S=24, L=40, d=32, seed=2)
    cfg = AttentionQuant(q=NVFP4_SR, k=NVFP4_SR, v=NVFP4_SR)
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv)
    o = fp4_attention(q, k, v, config=cfg)
    draws = [t.clone() for t in o.grad_fn.saved_tensors[:3]]
    o.backward(do)
    assert not torch.equal(draws[0], fq(q, -1))  # not round-to-nearest
    want = run(draws, do, config=AttentionQuant(q=None, k=None, v=None))
    assert_all_close((o.detach(), q.grad, k.grad, v.grad), want, rtol=0, atol=0)
    assert not torch.equal(run(qkv, do, config=cfg)[0], o.detach())


@pytest.mark.parametrize("rounding", [None, "rne"])
def test_requantize_along_forward_dims_rounding_alike_is_reuse(rounding):
    """Re-quantizing the unquantized Q, K, V along the forward's own block dims with the same
    rounding gives the forward's bits: the same numbers as reuse."""
    qkv, do = inputs(S=33, L=40, d=32, seed=4)
    cfg = ablated(reuse=False, requantize_along="forward", requantize_rounding=rounding)
    assert_all_close(run(qkv, do, config=cfg), run(qkv, do), rtol=0, atol=0)


def test_requantize_with_stochastic_rounding_is_fresh_and_unbiased():
    """requantize_rounding="stochastic": every backward draws new dQ/dK/dP operands (the
    output and dV, which use none, stay put). With dS in high precision, dQ = dS K̃ multiplies
    two independent draws (V in dS, K), so its mean over draws approaches dQ with the
    unquantized V and K in those GEMMs (S and P still the forward's)."""
    torch.manual_seed(0)  # the stochastic rounding's seeds come from torch's generator
    qkv, do = inputs(S=32, d=32, seed=6)
    cfg = ablated(ds=None, reuse=False, requantize_rounding="stochastic")
    draws = [run(qkv, do, config=cfg) for _ in range(64)]
    assert torch.equal(draws[0][0], draws[1][0]) and torch.equal(draws[0][3], draws[1][3])
    assert not torch.equal(draws[0][1], draws[1][1])
    q, k, v = (t.detach().double() for t in qkv)
    scale, mask = 1 / math.sqrt(32), causal_mask(32, 32)
    qh, kh, vh = fq(q, -1), fq(k, -1), fq(v, -2)
    p = ((qh @ kh.mT) * scale).masked_fill(~mask, float("-inf")).softmax(-1)
    delta = (do * (p @ vh)).sum(-1, keepdim=True)
    want = p * (do @ v.mT - delta) @ k * scale
    rne = run(qkv, do, config=AttentionQuant(ds=None, reuse=False))[1]
    assert torch.allclose(rne, p * (do @ fq(v, -1).mT - delta) @ fq(k, -2) * scale,
                          rtol=1e-9, atol=1e-9)
    mean = torch.stack([d[1] for d in draws]).mean(0)
    assert (mean - want).norm() < 0.3 * (rne - want).norm()  # measured 0.21-0.26 over seeds


# ---- delta: the softmax backward's row term -------------------------------------------------
@pytest.mark.parametrize("S,L,causal", [(24, 24, True), (17, 29, False)])
def test_delta_from_dp_is_the_softmax_gradient_of_the_backwards_dp(S, L, causal):
    """delta="dp": dS = P ∘ (dP - rowsum(P ∘ dP)), the softmax's gradient for the dP the
    backward computes. Only V is quantized here, and not reused: dP = dO V'ᵀ with V' blocked
    along d, while the forward's O = P V̂ has V̂ blocked along keys. So dQ and dK must be
    autograd's through softmax(QKᵀ) against V', which flash attention's rowsum(dO ∘ O) misses."""
    qkv, do = inputs(S=S, L=L, d=32, seed=5)
    q, k = (t.detach().clone().requires_grad_() for t in qkv[:2])
    s = (q @ k.transpose(-2, -1)) / math.sqrt(32)
    if causal:
        s = s.masked_fill(~causal_mask(S, L), float("-inf"))
    (torch.softmax(s, -1) @ fq(qkv[2].detach(), -1)).backward(do)
    cfg = ablated(q=None, k=None, ds=None, reuse=False, delta="dp")
    _, dq, dk, _ = run(qkv, do, config=cfg, causal=causal)
    torch.testing.assert_close(dq, q.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dk, k.grad, rtol=1e-10, atol=1e-12)
    _, dq_out, dk_out, _ = run(qkv, do, config=replace(cfg, ablation=None), causal=causal)
    assert not torch.allclose(dq_out, q.grad, rtol=1e-3)
    assert not torch.allclose(dk_out, k.grad, rtol=1e-3)


def test_delta_from_dp_is_flash_attentions_delta_under_reuse():
    """With the forward's V̂ in dP, rowsum(P ∘ dP) = rowsum(dO ∘ P V̂) = rowsum(dO ∘ O)."""
    qkv, do = inputs(S=33, L=40, d=32, seed=6)
    cfg = AttentionQuant(ds=None)
    assert_all_close(run(qkv, do, config=ablated(ds=None, delta="dp")), run(qkv, do, config=cfg),
                     rtol=1e-10, atol=1e-12)


# ---- masking, shapes, dtypes ---------------------------------------------------------------
def test_future_tokens_get_zero_gradient_and_no_influence():
    qkv, do = inputs(S=48, d=16, dtype=torch.float32)
    with torch.no_grad():  # keep each global amax in the past, so changing the future moves none
        for t in qkv:
            t[:, :, 0, 0] = 20.0
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv)
    o = fp4_attention(q, k, v)
    o[:, :, :16].sum().backward()
    assert (k.grad[:, :, 16:] == 0).all() and (v.grad[:, :, 16:] == 0).all()
    assert (q.grad[:, :, 16:] == 0).all() and k.grad[:, :, :16].abs().sum() > 0
    # Keys and values from position 16 on (their own 16-blocks of V) change nothing before.
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, 16:] = torch.randn_like(k2[:, :, 16:])
    v2[:, :, 16:] = torch.randn_like(v2[:, :, 16:])
    o2 = fp4_attention(q.detach(), k2, v2)
    assert torch.equal(o2[:, :, :16], o.detach()[:, :, :16])
    assert not torch.equal(o2[:, :, 16:], o.detach()[:, :, 16:])


def test_decode_rows_equal_the_last_rows_of_a_full_pass_when_off():
    qkv, do = inputs(S=29, d=32)
    q, k, v = (t.detach() for t in qkv)
    off = AttentionQuant.off()
    full = fp4_attention(q, k, v, config=off)
    torch.testing.assert_close(fp4_attention(q[:, :, -3:], k, v, config=off), full[:, :, -3:],
                               **TIGHT)


@pytest.mark.parametrize("d", [16, 32, 64])
def test_bf16_in_bf16_out_close_to_fp32(d):
    qkv, do = inputs(S=33, d=d, dtype=torch.bfloat16)
    got = run(qkv, do)
    assert all(t.dtype == torch.bfloat16 and torch.isfinite(t).all() for t in got)
    want = run([t.detach().float() for t in qkv], do.float())
    for a, b in zip(got, want, strict=True):  # one rounding of the result to bf16 apart
        torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["q", "k", "v", "p", "ds", "dp"])
def test_each_quantizer_flag_changes_the_result(name):
    qkv, do = inputs(S=32, d=32, dtype=torch.float32)
    base = run(qkv, do, config=AttentionQuant.off())
    got = run(qkv, do, config=AttentionQuant.only(name))
    changed = [not torch.allclose(a, b, rtol=1e-3, atol=1e-4)
               for a, b in zip(got, base, strict=True)]
    # Forward-side tensors move the output; backward-only ones leave it exactly as it was.
    assert changed[0] == (name in ("q", "k", "v", "p"))
    assert changed[1] or changed[2] or changed[3]
    if name not in ("q", "k", "v", "p"):
        assert torch.equal(got[0], base[0])


def test_config_validation():
    with pytest.raises(TypeError, match="AttentionQuant.q"):
        AttentionQuant(q="nvfp4")
    assert AttentionQuant(k=QuantSpec(block=(16, 16))).k.is_2d  # tiles (see the tiled tests)
    with pytest.raises(ValueError, match="hadamard"):
        AttentionQuant(v=QuantSpec(hadamard=True))
    with pytest.raises(ValueError, match="unknown"):
        AttentionQuant.only("o")
    with pytest.raises(TypeError, match="reuse"):
        AttentionQuant(reuse=1)
    with pytest.raises(ValueError, match="unknown name.*'o'"):
        ablated(reuse=("q", "o"))
    # One spelling per reuse set: all is True, none is False, else the names in q, k, v, p order.
    assert ablated(reuse=("p", "v", "k", "q")) == AttentionQuant()
    assert ablated(reuse=()).reuse is False
    partial = ablated(reuse=["v", "q"])
    assert partial.ablation.reuse == ("q", "v") and partial.reuses("v") and not partial.reuses("k")
    assert partial.describe() == "quantized: q, k, v, ds; reuse=q,v"
    with pytest.raises(ValueError, match="not one of"):
        partial.reuses("ds")
    with pytest.raises(ValueError, match="requantize=False.*set reuse=False"):
        ablated(requantize=False)
    with pytest.raises(TypeError, match="requantize"):
        ablated(reuse=False, requantize=0)
    assert ablated(reuse=False, requantize=False).describe() == (
        "quantized: q, k, v, ds; reuse=False; the others unquantized in the backward")
    with pytest.raises(ValueError, match="reblock=True.*set reuse=True"):
        ablated(reuse=False, reblock=True)
    with pytest.raises(TypeError, match="reblock"):
        ablated(reblock=1)
    assert ablated(reuse=("v",), reblock=True).describe() == (
        "quantized: q, k, v, ds; reuse=v; reused values re-blocked")
    assert AttentionQuant(p=QuantSpec.none()).p is None
    assert not AttentionQuant.off().quantizes and AttentionQuant.paper() == AttentionQuant()
    assert AttentionQuant.paper().describe() == "quantized: q, k, v, ds; reuse=True"
    with pytest.raises(TypeError, match="rotate_qk"):
        ablated(rotate_qk=1)
    with pytest.raises(ValueError, match="rotate_qk=True.*neither q nor k"):
        ablated(q=None, k=None, rotate_qk=True)
    with pytest.raises(ValueError, match="requantize_along must be one of"):
        ablated(reuse=False, requantize_along="keys")
    with pytest.raises(ValueError, match="requantize_rounding must be None"):
        ablated(reuse=False, requantize_rounding="sr")
    with pytest.raises(ValueError, match="re-quantizes none: set reuse=False"):
        ablated(requantize_along="forward")
    with pytest.raises(ValueError, match="re-quantizes none"):
        ablated(reuse=False, requantize=False, requantize_rounding="stochastic")
    assert ablated(reuse=False, requantize_along="forward",
                          requantize_rounding="stochastic").describe() == (
        "quantized: q, k, v, ds; reuse=False; the others re-quantized along the forward dims "
        "with stochastic rounding")
    sr_tiles = replace(NVFP4_SR, block=(16, 16))
    assert AttentionQuant(q=NVFP4_SR, v=sr_tiles).describe() == (
        "quantized: q (stochastic), k, v (16x16 tiles, stochastic), ds; reuse=True")
    with pytest.raises(ValueError, match="delta must be one of"):
        ablated(delta="o")
    assert ablated(reuse=False, delta="dp").describe() == (
        "quantized: q, k, v, ds; reuse=False; delta = rowsum(P ∘ dP)")
    assert ablated(rotate_qk=True).describe().endswith(
        "; Q, K Hadamard-rotated along head_dim")
    # The ablation is one optional field: one that changes nothing is stored as None, a
    # partial reuse stands in for reuse=False only, and the field takes an AttentionAblation.
    assert AttentionQuant(reuse=False, ablation=AttentionAblation()).ablation is None
    assert ablated(reuse=False, delta="output") == AttentionQuant(reuse=False)
    with pytest.raises(ValueError, match="partial reuse.*set reuse=False"):
        AttentionQuant(ablation=AttentionAblation(reuse=("v",)))
    with pytest.raises(ValueError, match=r"not a partial reuse.*reuse=True\) for all"):
        AttentionAblation(reuse=("q", "k", "v", "p"))
    with pytest.raises(TypeError, match="AttentionQuant.ablation must be an AttentionAblation"):
        AttentionQuant(ablation={"reblock": True})
    (q, k, v), _ = inputs(S=4, d=24)
    with pytest.raises(ValueError, match="rotate_qk=True needs head_dim.*multiple of 16, got 24"):
        fp4_attention(q, k, v, config=ablated(rotate_qk=True))
    (q, k, v), _ = inputs(S=4, d=16)
    with pytest.raises(ValueError, match="head_dim"):
        fp4_attention(q, k[..., :8], v[..., :8])
    with pytest.raises(ValueError, match="S <= L"):
        fp4_attention(q, k[:, :, :2], v[:, :, :2])
    with pytest.raises(TypeError, match="boolean"):
        fp4_attention(q, k, v, mask=torch.ones(4, 4))
    with pytest.raises(TypeError, match="AttentionQuant"):
        fp4_attention(q, k, v, config=QuantSpec())


# ---- the GPT hook --------------------------------------------------------------------------
def test_off_gives_the_original_gpt_logits_with_and_without_padding():
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    idx = torch.randint(0, 256, (2, 20))
    pad = torch.ones(2, 20, dtype=torch.bool)
    pad[0, :7] = False
    want, want_padded = model(idx)[0], model(idx, attention_mask=pad)[0]
    use_fp4_attention(model, AttentionQuant.off())
    torch.testing.assert_close(model(idx)[0], want, rtol=1e-5, atol=1e-5)
    got = model(idx, attention_mask=pad)[0]
    torch.testing.assert_close(got[pad], want_padded[pad], rtol=1e-5, atol=1e-5)
    out = model.generate(idx[:, :5], 4, temperature=0)  # KV-cache decoding: q shorter than k
    torch.manual_seed(0)
    assert torch.equal(out, GPT(GPTConfig.tiny()).generate(idx[:, :5], 4, temperature=0))


def test_fp4_attention_gpt_trains():
    torch.manual_seed(0)
    model = use_fp4_attention(GPT(GPTConfig.tiny()))
    idx = torch.randint(0, 256, (2, 24))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    with pytest.raises(ValueError, match="no fp4stack Attention"):
        use_fp4_attention(torch.nn.Linear(2, 2))
