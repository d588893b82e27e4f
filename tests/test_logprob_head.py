"""The chunked log-prob head equals the plain computation bit for bit: log-probs, entropy and the
gradient of the logits, for any chunking, dtype and temperature; and token_logprobs through it
equals the whole-tensor scoring it replaced, parameter gradients included."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4stack.models.gpt import GPT, GPTConfig
from fp4stack.rl import policy as lm
from fp4stack.rl.logprob_head import plain_target_logprobs, target_logprobs

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _both(logits, targets, temperature, chunk_elements, dtype):
    """(log-probs, entropy, d loss / d logits) of the chunked and the plain path, for a loss
    that weights every log-prob differently."""
    out = []
    weights = torch.randn(targets.shape, generator=torch.Generator().manual_seed(1))
    for fn, kw in ((target_logprobs, {"chunk_elements": chunk_elements}),
                   (plain_target_logprobs, {})):
        x = logits.to(dtype).detach().requires_grad_(True)
        lp, ent = fn(x, targets, temperature, entropy=True, **kw)
        (lp * weights.to(lp.device)).sum().backward()
        out.append((lp.detach(), ent, x.grad))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 100])
def test_chunked_equals_plain(device, dtype, temperature, chunk_rows):
    g = torch.Generator().manual_seed(0)
    V = 97
    logits = (torch.randn(4, 5, V, generator=g) * 4).to(device)
    targets = torch.randint(0, V, (4, 5), generator=g).to(device)
    chunked, plain = _both(logits, targets, temperature, chunk_rows * V, dtype)
    for a, b in zip(chunked, plain, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert chunked[2].dtype == dtype  # the gradient comes back in the logits' dtype


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 12), vocab=st.integers(1, 64), chunk=st.integers(1, 200),
       scale=st.sampled_from([0.1, 1.0, 30.0]))
def test_chunked_equals_plain_any_shape(rows, vocab, chunk, scale):
    g = torch.Generator().manual_seed(rows * 1000 + vocab)
    logits = torch.randn(rows, vocab, generator=g) * scale
    targets = torch.randint(0, vocab, (rows,), generator=g)
    chunked, plain = _both(logits, targets, 1.0, chunk, torch.float32)
    for a, b in zip(chunked, plain, strict=True):
        assert torch.equal(a, b)


def test_entropy_is_detached_and_optional():
    logits = torch.randn(2, 3, 11, requires_grad=True)
    targets = torch.randint(0, 11, (2, 3))
    lp = target_logprobs(logits, targets)
    assert lp.shape == (2, 3) and lp.requires_grad
    lp, ent = target_logprobs(logits, targets, entropy=True)
    assert not ent.requires_grad and ent.shape == (2, 3)
    assert torch.all(ent >= 0)


def test_bad_arguments_name_the_problem():
    logits = torch.randn(2, 3, 11)
    with pytest.raises(ValueError, match="targets"):
        target_logprobs(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_elements"):
        target_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), chunk_elements=0)


def _whole_tensor_token_logprobs(model, tokens, mask, temperature=1.0):
    """token_logprobs as it was before the chunked head: every [B, L, V] tensor whole."""
    logits = lm.forward_logits(model, tokens, mask)[:, :-1].float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    mask = mask.bool()
    scored = F.pad(mask[:, 1:] & mask[:, :-1], (1, 0))
    lp = F.pad(logp_all.gather(-1, tokens[:, 1:, None]).squeeze(-1), (1, 0))
    lp = lp.masked_fill(~scored, 0.0)
    with torch.no_grad():
        ent = -(logp_all.exp() * logp_all).sum(-1)
    return lp, F.pad(ent, (1, 0)).masked_fill(~scored, 0.0)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_token_logprobs_equal_the_whole_tensor_scoring(autocast, temperature):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, ffn_hidden=64, max_seq_len=16,
                    moe=True, n_experts=4, top_k=2, moe_hidden=32)
    model = GPT(cfg)
    tokens = torch.randint(1, 50, (3, 10))
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[0, :4] = False  # a left-padded row
    tokens[0, :4] = 0
    adv = torch.randn(3, 10)
    results = []
    for fn in (lambda: lm.token_logprobs(model, tokens, mask, temperature, entropy=True),
               lambda: _whole_tensor_token_logprobs(model, tokens, mask, temperature)):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            lp, ent = fn()
        (lp * adv).sum().backward()
        results.append((lp.detach(), ent, [p.grad.clone() for p in model.parameters()]))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results
    assert torch.equal(lp_a, lp_b) and torch.equal(ent_a, ent_b)
    assert lp_a[0, :5].eq(0).all() and lp_a[:, 0].eq(0).all()
    for a, b in zip(g_a, g_b, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunked_equals_plain_at_a_real_vocabulary_on_cuda():
    """SmolLM2's 49,152-token vocabulary in bfloat16, where CUDA's softmax kernels differ from
    the small-vocabulary ones above; chunks of 21 rows against 600 whole."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 200, 49152, generator=g) * 3).cuda()
    targets = torch.randint(0, 49152, (3, 200), generator=g).cuda()
    chunked, plain = _both(logits, targets, 1.0, 21 * 49152, torch.bfloat16)
    for a, b in zip(chunked, plain, strict=True):
        assert torch.equal(a, b)
