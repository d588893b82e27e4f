"""Full-Stack FP4's attention in the paper's form (AttentionQuant.qk_ds): the QKᵀ and dS GEMMs
in NVFP4, PV, Pᵀ dO and dO Vᵀ in high precision, Q and K reused or re-quantized in the
backward. Checked against an independent float64 reference of the forward and backward, the
Triton kernels (V taken unquantized) against the reference, and as a recipe's attention
composed with the linear recipes in a GPT."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import replace

import pytest
import torch

from fp4stack import QuantSpec, fake_quantize, recipe
from fp4stack.convert import quantize_model
from fp4stack.models import GPT, GPTConfig
from fp4stack.nn.attention import AttentionQuant, fp4_attention

TIGHT = dict(rtol=1e-10, atol=1e-10)


def inputs(B=1, H=2, S=32, L=None, d=32, Hkv=None, seed=0):
    L, Hkv = L or S, Hkv or H
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return (draw(B, H, S, d), draw(B, Hkv, L, d), draw(B, Hkv, L, d)), draw(B, H, S, d)


def run(qkv, do, config, **kw):
    q, k, v = (t.clone().requires_grad_() for t in qkv)
    o = fp4_attention(q, k, v, config=config, **kw)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def fq(t, dim):
    """NVFP4 (1x16 RNE) values of t in blocks along `dim`, padded with zeros to whole blocks
    (zeros change no scale), as float64."""
    x = t.transpose(dim, -1).float()
    n = x.shape[-1]
    x = torch.nn.functional.pad(x, (0, -n % 16)).contiguous()
    return fake_quantize(x, spec=QuantSpec())[..., :n].double().transpose(dim, -1)


def reference(qkv, do, reuse: bool, causal=True):
    """The paper's attention written out in float64: S = Q̂ K̂ᵀ (blocks along d), P, O = P V
    with V unquantized; dV = Pᵀ dO, dP = dO Vᵀ unquantized; dS = P ∘ (dP - rowsum(dO ∘ O));
    dQ = dŜ K', dK = dŜᵀ Q' with dŜ in blocks along each GEMM's reduction dim, and K', Q' the
    forward's K̂, Q̂ (reuse) or K, Q quantized along the keys / queries (no reuse)."""
    q, k, v = qkv
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    S, L, d = q.shape[2], k.shape[2], q.shape[3]
    scale = 1 / math.sqrt(d)
    allowed = torch.ones(S, L, dtype=torch.bool).tril(L - S) if causal else \
        torch.ones(S, L, dtype=torch.bool)
    qh, kh = fq(q, -1), fq(k, -1)
    s = (qh @ kh.mT * scale).masked_fill(~allowed, float("-inf"))
    p = s.softmax(-1)
    o = p @ v
    dv = p.mT @ do
    dp = do @ v.mT
    ds = p * (dp - (do * o).sum(-1, keepdim=True))
    k_dq, q_dk = (kh, qh) if reuse else (fq(k, -2), fq(q, -2))
    dq = fq(ds, -1) @ k_dq * scale
    dk = fq(ds, -2).mT @ q_dk * scale
    if groups > 1:
        dk, dv = (t.unflatten(1, (-1, groups)).sum(2) for t in (dk, dv))
    return o, dq, dk, dv


def assert_all_close(got, want, **tol):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, n=name: f"{n}: {m}")


def test_the_config_quantizes_q_k_and_ds_only():
    cfg = AttentionQuant.qk_ds()
    assert (cfg.v, cfg.p, cfg.dp) == (None, None, None) and cfg.reuse
    assert cfg.q == cfg.k == cfg.ds == AttentionQuant.paper().q
    assert AttentionQuant.qk_ds(reuse=False) == AttentionQuant(v=None, reuse=False)
    assert "quantized: q, k, ds" in cfg.describe()


@pytest.mark.parametrize(("S", "L", "d", "H", "Hkv"), [
    (1, 1, 16, 2, 2), (17, 17, 32, 2, 2), (33, 33, 64, 2, 2), (7, 40, 32, 2, 2),
    (24, 24, 32, 4, 2), (5, 21, 16, 4, 1)])
@pytest.mark.parametrize("reuse", [True, False])
def test_matches_float64_reference(S, L, d, H, Hkv, reuse):
    qkv, do = inputs(S=S, L=L, d=d, H=H, Hkv=Hkv, seed=S + L + d)
    got = run(qkv, do, AttentionQuant.qk_ds(reuse=reuse))
    assert_all_close(got, reference(qkv, do, reuse), **TIGHT)


def test_non_causal_matches_float64_reference():
    qkv, do = inputs(S=20, d=32)
    got = run(qkv, do, AttentionQuant.qk_ds(), causal=False)
    assert_all_close(got, reference(qkv, do, True, causal=False), **TIGHT)


def test_v_and_the_p_gemms_stay_high_precision():
    # Against attention with V quantized (the earlier form): the output and dV differ; and
    # with V and dS unquantized too, dV is exactly Pᵀ dO of the NVFP4 scores.
    qkv, do = inputs(S=24, d=32, seed=4)
    ours = run(qkv, do, AttentionQuant.qk_ds())
    quantized_v = run(qkv, do, AttentionQuant.paper())
    assert not torch.allclose(ours[0], quantized_v[0], rtol=1e-4, atol=1e-4)
    q_k_only = run(qkv, do, AttentionQuant.only("q", "k"))
    assert torch.equal(ours[0], q_k_only[0]) and torch.equal(ours[3], q_k_only[3])
    assert not torch.allclose(ours[1], q_k_only[1], rtol=1e-4, atol=1e-4)  # dS is NVFP4


def test_reuse_changes_only_the_ds_gemms_q_k_operands():
    qkv, do = inputs(S=24, d=32, seed=5)
    reuse = run(qkv, do, AttentionQuant.qk_ds())
    fresh = run(qkv, do, AttentionQuant.qk_ds(reuse=False))
    assert torch.equal(reuse[0], fresh[0]) and torch.equal(reuse[3], fresh[3])
    assert not torch.allclose(reuse[1], fresh[1], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(reuse[2], fresh[2], rtol=1e-4, atol=1e-4)


# ---- on the Triton kernels (CUDA tensors, or the interpreter on CPU) ---------------------
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 inputs: only the order of the sums differs from the reference (test_attention_kernel).
GRAD_TOL = dict(atol=4e-6, rtol=1e-5)


def both_backends(qkv, do, config, dtype=torch.float32, **kw):
    """(out, dq, dk, dv) of the reference and of the kernels, inputs of `dtype` on DEVICE; the
    reference takes the same values in fp32."""
    lo = [t.to(DEVICE, dtype) for t in (*qkv, do)]
    got = run(lo[:3], lo[3], config, backend="triton", **kw)
    want = run([t.float() for t in lo[:3]], lo[3].float(), config, backend="torch", **kw)
    return got, want


@needs_triton
@pytest.mark.parametrize(("S", "L", "d", "H", "Hkv"), [
    (17, 17, 16, 2, 2), (33, 40, 32, 4, 2), (5, 33, 16, 3, 1), (32, 32, 64, 2, 1)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("reuse", [True, False])
def test_the_kernels_match_the_reference(S, L, d, H, Hkv, causal, reuse):
    # V enters the kernels unquantized (its own units, decode factor 1): the same GEMMs as the
    # reference's, to the order of the sums.
    qkv, do = inputs(B=2, H=H, S=S, L=L, d=d, Hkv=Hkv, seed=S + L)
    got, want = both_backends(qkv, do, AttentionQuant.qk_ds(reuse=reuse), causal=causal)
    assert_all_close(got, want, **GRAD_TOL)


@needs_triton
def test_the_kernels_take_v_as_it_is():
    from fp4stack.kernels.attention_common import RAW_AMAX
    from fp4stack.nn import attention_ops

    qkv, do = inputs(S=24, d=32, seed=6)
    q, k, v = (t.to(DEVICE, torch.float32) for t in qkv)
    *_, amax, qu, ku, vu = attention_ops.attention_forward(q, k, v, True, 0.25, False, None,
                                                          None, None, False)
    assert torch.equal(vu, v) and vu.data_ptr() != v.data_ptr()  # a copy: ops return no input
    assert float(amax[2]) == RAW_AMAX
    *_, quantized = attention_ops.attention_forward(q, k, v, True, 0.25, False, None, None, None)
    assert not torch.equal(quantized, v)
    # the quantized-V form still differs from the paper's where V matters: out and dP
    ours, paper = (both_backends(qkv, do, c)[0] for c in (AttentionQuant.qk_ds(),
                                                           AttentionQuant.paper()))
    assert not torch.allclose(ours[0], paper[0], rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("reuse", [True, False])
def test_the_kernels_bf16(reuse):
    # bf16 inputs against the reference on the same values in fp32 (P enters its dots in bf16,
    # O is rounded to bf16: see test_attention_kernel.test_backward_16bit); measured relative
    # Frobenius errors on CPU: out 4.1e-3, dq 2.6e-2, dk 2.1e-2, dv 5.7e-3 (V quantized by
    # mistake would put out's near NVFP4's ~1e-1).
    qkv, do = inputs(H=4, S=33, d=32, Hkv=2, seed=8)
    got, want = both_backends(qkv, do, AttentionQuant.qk_ds(reuse=reuse), dtype=torch.bfloat16)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == torch.bfloat16, name
        assert (a.float() - b).norm() / b.norm() < 5e-2, name


@needs_triton
def test_an_ablation_with_v_unquantized_stays_on_the_reference():
    from fp4stack.nn.attention_ablation import AttentionAblation
    from fp4stack.nn.attention_kernels import kernel_config

    assert kernel_config(AttentionQuant.qk_ds()) and kernel_config(AttentionQuant.qk_ds(False))
    rotated = AttentionAblation.quant(rotate_qk=True)
    assert kernel_config(rotated)
    assert not kernel_config(replace(rotated, v=None))
    qkv, _ = inputs(S=16, d=32)
    with pytest.raises(ValueError, match="fp4_attention\\(backend='triton'\\)"):
        fp4_attention(*(t.float() for t in qkv), config=replace(rotated, v=None),
                      backend="triton")


# ---- as a recipe's attention ------------------------------------------------------------
def test_recipes_compose_it_with_the_linears():
    assert recipe("fullstack-paper").attention == AttentionQuant.qk_ds()
    assert recipe("fullstack-paper-noreuse").attention == AttentionQuant.qk_ds(reuse=False)
    r = recipe("nvfp4-4over6-attention")
    assert r == recipe("nvfp4-4over6").with_(name="nvfp4-4over6-attention",
                                             attention=AttentionQuant.qk_ds())
    mine = recipe({"preset": "lowrank-nvidia", "name": "mine", "attention": {"v": None}})
    assert mine.attention == AttentionQuant.qk_ds() and mine.lowrank == recipe("lowrank").lowrank


def gpt_loss(name: str | None, idx):
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    if name is not None:
        quantize_model(model, recipe(name))
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    return model, loss.detach()


def test_a_gpt_under_the_paper_recipes_runs_its_attention_and_trains():
    idx = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    _, linears_only = gpt_loss("nvfp4-4over6", idx)
    model, with_attention = gpt_loss("nvfp4-4over6-attention", idx)
    assert not torch.equal(linears_only, with_attention)  # the attention is the paper's
    assert all("attend" in vars(b.self_attn) for b in model.model.layers)
    model, loss = gpt_loss("fullstack-paper", idx)
    assert math.isfinite(float(loss))
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
