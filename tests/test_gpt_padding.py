"""GPT on left-padded batches: each row gives its own unpadded logits, with and without a KV cache,
in generate, in gradients and in the MoE aux loss; the no-mask path is left as it was."""

import pytest
import torch
import torch.nn.functional as F

from fp4stack.models import GPT, GPTConfig, KVCache
from fp4stack.nn.moe import MoEBlock

CONFIGS = {"dense": GPTConfig.tiny, "moe": GPTConfig.tiny_moe}
LENGTHS = (9, 4, 12, 1)


def make(kind="dense", dtype=torch.float64, seed=0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(CONFIGS[kind](qk_norm=True, **overrides)).to(dtype)


def sequences(lengths=LENGTHS, seed=1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g) for n in lengths]


def left_pad(seqs: list[torch.Tensor], seed=2) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-aligned rows; pad ids are random so that nothing may depend on them."""
    width = max(len(s) for s in seqs)
    idx = torch.randint(0, 256, (len(seqs), width), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        idx[i, width - len(s):] = s
        mask[i, width - len(s):] = True
    return idx, mask


def tol(dtype):
    return dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("kind", "dtype"), [("dense", torch.float32), ("dense", torch.float64),
                                             ("moe", torch.float64)])
def test_padded_rows_match_unpadded_runs(kind, dtype):
    model = make(kind, dtype)
    seqs = sequences()
    idx, mask = left_pad(seqs)
    logits = model(idx, attention_mask=mask)[0]
    assert torch.isfinite(logits).all()  # pad rows too: a pad query attends to itself
    for i, s in enumerate(seqs):
        alone = model(s[None])[0][0]
        torch.testing.assert_close(logits[i, mask[i]], alone, **tol(dtype))
    # 0/1 integers mean the same as booleans.
    torch.testing.assert_close(model(idx, attention_mask=mask.long())[0], logits, rtol=0, atol=0)


def test_all_ones_mask_matches_no_mask():
    model = make("moe")
    idx = torch.stack(sequences((10, 10)))
    ref = model(idx)[0]
    torch.testing.assert_close(model(idx, attention_mask=torch.ones_like(idx))[0], ref,
                               **tol(torch.float64))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_kv_cache_decoding_with_growing_mask(kind):
    model = make(kind)
    seqs = sequences(seed=3)
    prompt, mask = left_pad(seqs)
    steps = torch.randint(0, 256, (len(seqs), 6), generator=torch.Generator().manual_seed(4))
    caches = [KVCache(prompt.shape[1] + steps.shape[1]) for _ in model.model.layers]
    out = [model(prompt, kv_caches=caches, attention_mask=mask)[0][:, -1]]
    # One token at a time, then two at once: the caller grows the mask with the new columns.
    for t in range(4):
        mask = torch.cat((mask, torch.ones(len(seqs), 1, dtype=torch.bool)), dim=1)
        out.append(model(steps[:, t:t + 1], kv_caches=caches, attention_mask=mask)[0][:, -1])
    mask = torch.cat((mask, torch.ones(len(seqs), 2, dtype=torch.bool)), dim=1)
    pair = model(steps[:, 4:6], kv_caches=caches, attention_mask=mask)[0]
    out += [pair[:, 0], pair[:, 1]]
    for i, s in enumerate(seqs):
        full = model(torch.cat((s, steps[i]))[None])[0][0, len(s) - 1:]
        torch.testing.assert_close(torch.stack([o[i] for o in out]), full, **tol(torch.float64))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_generate_with_mask_matches_per_sequence_generate(kind):
    model = make(kind)
    seqs = sequences(seed=5)
    prompt, mask = left_pad(seqs)
    out = model.generate(prompt, 7, temperature=0, attention_mask=mask)
    assert out.shape == (len(seqs), prompt.shape[1] + 7) and torch.equal(out[:, :prompt.shape[1]],
                                                                          prompt)
    for i, s in enumerate(seqs):
        alone = model.generate(s[None], 7, temperature=0)
        assert torch.equal(out[i, prompt.shape[1]:], alone[0, len(s):])


def test_padded_loss_gradients_equal_per_sequence_gradients():
    # The RL trainer's use: one padded forward/backward instead of one per sequence.
    seqs = sequences(seed=6)
    idx, mask = left_pad(seqs)
    # Only real tokens predicting real tokens: a pad does not predict the first real token.
    targets = torch.where(mask[:, :-1] & mask[:, 1:], idx[:, 1:], -100)
    model = make("dense")
    logits = model(idx[:, :-1], attention_mask=mask[:, :-1])[0]
    F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").backward()
    padded = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for s in (s for s in seqs if len(s) > 1):
        out = model(s[None, :-1])[0][0]
        F.cross_entropy(out, s[1:], reduction="sum").backward()
    for n, p in model.named_parameters():
        assert torch.isfinite(padded[n]).all()
        torch.testing.assert_close(padded[n], p.grad, rtol=1e-9, atol=1e-11, msg=n)


def test_moe_aux_loss_counts_real_tokens_only():
    model = make("moe", aux_loss_coef=1.0)
    seqs = sequences((6, 6), seed=7)
    model(torch.stack(seqs))
    ref = model.aux_loss
    idx, mask = left_pad(seqs)
    wide = torch.cat((torch.randint(0, 256, (2, 3)), idx), dim=1)  # three pads in front of both
    wide_mask = torch.cat((torch.zeros(2, 3, dtype=torch.bool), mask), dim=1)
    model(wide, attention_mask=wide_mask)
    torch.testing.assert_close(model.aux_loss, ref, rtol=1e-10, atol=1e-10)
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    assert all(b.aux_loss.requires_grad for b in blocks)
    with model.record_routing() as routing:
        model(wide, attention_mask=wide_mask)
    assert all(r.shape == (2, 9, 2) for r in routing.values())  # pads are routed and recorded


def test_bad_mask_shape_is_refused():
    model = make()
    idx = torch.stack(sequences((5, 5)))
    with pytest.raises(ValueError, match="attention_mask"):
        model(idx, attention_mask=torch.ones(2, 4))
    caches = [KVCache(8) for _ in model.model.layers]
    model(idx, kv_caches=caches, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"\(2, 6\)"):  # must cover the cached positions too
        model(idx[:, :1], kv_caches=caches, attention_mask=torch.ones(2, 1))


def test_no_mask_prefill_keeps_is_causal_sdpa_and_old_attend_overrides(monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = make()
    idx = torch.stack(sequences((8, 8)))
    ref = model(idx)[0]
    assert calls and all(c == {"is_causal": True} for c in calls)
    calls.clear()
    model(idx, attention_mask=torch.ones_like(idx))
    assert all(c["attn_mask"].shape == (2, 1, 8, 8) for c in calls)
    # An attend override written for three arguments still serves the no-mask path.
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.attend = lambda q, k, v, _orig=attn.attend: _orig(q, k, v)
    torch.testing.assert_close(model(idx)[0], ref, rtol=0, atol=0)


def test_attend_override_sees_a_mask_with_no_empty_row():
    # A plain masked softmax, as an FP4 attention override might compute it, would give NaN on
    # a query row with no key allowed; the mask's True diagonal rules that out on every backend.
    def naive_attend(q, k, v, mask=None):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v

    model = make("moe")
    idx, mask = left_pad(sequences(seed=8))
    ref = model(idx, attention_mask=mask)[0]
    for layer in model.model.layers:
        layer.self_attn.attend = naive_attend
    logits = model(idx, attention_mask=mask)[0]
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits[mask], ref[mask], **tol(torch.float64))
