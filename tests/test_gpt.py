"""GPT: forward/backward, causality, GQA, tied weights, config checks, KV cache, routing replay,
Hugging Face Qwen3 equivalence, and a tiny overfit run."""

import math

import pytest
import torch
import torch.nn.functional as F

from fp4stack.models import GPT, GPTConfig
from fp4stack.nn.moe import MoEBlock

CONFIGS = {"dense": GPTConfig.tiny, "moe": GPTConfig.tiny_moe}


def make(kind="dense", dtype=torch.float32, seed=0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(CONFIGS[kind](**overrides)).to(dtype)


def tokens(b=2, s=16, vocab=256, seed=1) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_forward_backward(kind):
    model = make(kind)
    idx = tokens()
    logits, loss = model(idx[:, :-1], idx[:, 1:])
    assert logits.shape == (2, 15, 256)
    assert abs(loss.item() - math.log(256)) < 0.1  # near-uniform at init
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert missing == []
    assert model(idx)[1] is None


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # qk-norm, autocast
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_bf16_weights_and_autocast(kind):
    idx = tokens()
    model = make(kind, torch.bfloat16)
    logits, loss = model(idx[:, :-1], idx[:, 1:])
    assert logits.dtype == torch.bfloat16 and torch.isfinite(loss)
    loss.backward()
    model = make(kind)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(idx[:, :-1], idx[:, 1:])
    assert logits.dtype == torch.bfloat16 and torch.isfinite(loss)
    loss.backward()
    assert model.lm_head.weight.grad.dtype == torch.float32


def test_moe_loss_adds_aux_loss():
    model = make("moe", aux_loss_coef=0.5)
    idx = tokens()
    logits, loss = model(idx[:, :-1], idx[:, 1:])
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    aux = sum(b.aux_loss for b in blocks)
    torch.testing.assert_close(model.aux_loss, aux)
    ce = F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
    torch.testing.assert_close(loss, ce + 0.5 * aux)
    assert aux.item() >= len(blocks) * 2 * 0.9  # ~k per layer when near-balanced, >= k/E*E


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_causal(kind):
    model = make(kind, torch.float64)
    idx = tokens()
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    a, b = model(idx)[0], model(changed)[0]
    # Not bitwise for MoE: the other tokens sharing an expert GEMM change its blocking.
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_module_names_are_hf_like():
    names = dict(make("moe").named_parameters())
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.1.self_attn.k_norm.weight",
                 "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
                 "model.layers.0.mlp.router.gate.weight", "model.layers.0.input_layernorm.weight",
                 "model.norm.weight", "lm_head.weight"):
        assert name in names
    assert "model.layers.0.mlp.gate_proj.weight" in dict(make().named_parameters())


def test_gqa_shapes_and_attention_reference():
    model = make(n_heads=8, n_kv_heads=2, dim=64)  # head_dim 8, 4 query heads per K/V head
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (64, 64)
    assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (16, 64)
    q, k, v = torch.randn(2, 8, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    ref = torch.empty_like(q)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    for h in range(8):  # query head h reads K/V head h // 4
        s = (q[:, h] @ k[:, h // 4].transpose(-1, -2)) / math.sqrt(8)
        ref[:, h] = s.masked_fill(~causal, float("-inf")).softmax(-1) @ v[:, h // 4]
    torch.testing.assert_close(attn.attend(q, k, v), ref)
    assert model(tokens())[0].shape == (2, 16, 256)


def test_tied_embeddings_share_storage():
    tied, untied = make(tie_embeddings=True), make()
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    assert untied.num_params() - tied.num_params() == 256 * 64
    assert tied.to(torch.float64).lm_head.weight is tied.model.embed_tokens.weight


def test_num_params_active():
    model = make("moe")
    cfg = model.config
    experts = cfg.n_layers * cfg.n_experts * 3 * cfg.dim * cfg.moe_hidden
    assert model.num_params() - model.num_params(active=True) == experts // 2  # top-2 of 4


@pytest.mark.parametrize(("overrides", "field"), [
    (dict(n_kv_heads=3), "n_kv_heads"),
    (dict(dim=62), "n_heads"),
    (dict(head_dim=7), "head_dim"),
    (dict(top_k=5), "top_k"),
    (dict(n_layers=0), "n_layers"),
    (dict(vocab_size=2.5), "vocab_size"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(rope_theta=-1.0), "rope_theta"),
    (dict(aux_loss_coef=-0.1), "aux_loss_coef"),
])
def test_config_validation(overrides, field):
    with pytest.raises(ValueError, match=f"GPTConfig.{field}"):
        GPTConfig.tiny_moe(**overrides)


def test_explicit_head_dim():
    model = make(head_dim=32)  # dim 64, 4 heads of 32 (as Qwen3 allows)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (128, 64)
    assert model(tokens())[0].shape == (2, 16, 256)


def test_sequence_longer_than_max_seq_len():
    with pytest.raises(ValueError, match="max_seq_len"):
        make()(tokens(1, 65))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_kv_cache_matches_full_forward(kind):
    from fp4stack.models import KVCache

    model = make(kind, torch.float64)
    idx = tokens(2, 12)
    full = model(idx)[0]
    caches = [KVCache(12) for _ in model.model.layers]
    steps = [model(idx[:, :5], kv_caches=caches)[0], model(idx[:, 5:8], kv_caches=caches)[0]]
    steps += [model(idx[:, t:t + 1], kv_caches=caches)[0] for t in range(8, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)


def test_generate_greedy_matches_uncached_argmax():
    model = make("moe", torch.float64)
    prompt = tokens(2, 5)
    out = model.generate(prompt, 6, temperature=0)
    assert out.shape == (2, 11) and torch.equal(out[:, :5], prompt)
    ref = prompt
    for _ in range(6):
        ref = torch.cat((ref, model(ref)[0][:, -1:].argmax(-1)), dim=1)
    assert torch.equal(out, ref)


def test_generate_sampling_top_k_and_limits():
    model = make()
    g = torch.Generator().manual_seed(0)
    a = model.generate(tokens(2, 4), 8, temperature=1.0, top_k=1, generator=g)
    assert torch.equal(a, model.generate(tokens(2, 4), 8, temperature=0))  # top-1 is greedy
    b = model.generate(tokens(2, 4), 8, generator=torch.Generator().manual_seed(3))
    c = model.generate(tokens(2, 4), 8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(b, c)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.generate(tokens(1, 60), 10)


def test_routing_replay_model_wide():
    model = make("moe", torch.float64)
    idx = tokens()
    with model.record_routing() as routing:
        logits = model(idx)[0]
    assert sorted(routing) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(r.shape == (2, 16, 2) for r in routing.values())
    with model.replay_routing(routing):
        assert torch.equal(model(idx)[0], logits)
    other = {name: (r + 1) % 4 for name, r in routing.items()}
    with model.replay_routing(other), model.record_routing() as seen:
        forced_logits = model(idx)[0]
    assert all(torch.equal(seen[n], other[n]) for n in other)
    assert not torch.allclose(forced_logits, logits)


def test_generation_routing_replays_on_the_full_sequence():
    # The RL use: record routing while sampling, replay it in the trainer's full forward.
    model = make("moe", torch.float64)
    with model.record_routing() as routing:
        out = model.generate(tokens(2, 5), 6, temperature=0)
    with model.record_routing() as full:
        logits = model(out[:, :-1])[0]
    assert all(torch.equal(routing[n], full[n]) for n in full)
    with model.replay_routing(routing):
        torch.testing.assert_close(model(out[:, :-1])[0], logits, rtol=0, atol=0)


def _to_hf(model: GPT, moe: bool):
    """The matching transformers Qwen3 / Qwen3-MoE model, loaded with this model's weights."""
    transformers = pytest.importorskip("transformers")
    c = model.config
    common = dict(vocab_size=c.vocab_size, hidden_size=c.dim, num_hidden_layers=c.n_layers,
                  num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                  head_dim=c.head_size, rope_theta=c.rope_theta, rms_norm_eps=c.norm_eps,
                  intermediate_size=c.ffn_hidden, max_position_embeddings=c.max_seq_len,
                  tie_word_embeddings=c.tie_embeddings, attn_implementation="eager")
    if moe:
        hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            num_experts=c.n_experts, num_experts_per_tok=c.top_k,
            moe_intermediate_size=c.moe_hidden, norm_topk_prob=c.norm_topk_prob,
            experts_implementation="eager", **common))
    else:
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    state = {k.replace("mlp.router.gate", "mlp.gate"): v for k, v in model.state_dict().items()}
    hf.load_state_dict(state, strict=True)
    return hf.to(torch.float64).eval()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_matches_transformers_qwen3(kind):
    model = make(kind, torch.float64)
    hf = _to_hf(model, kind == "moe")
    idx = tokens()
    # HF computes RMSNorm and the router softmax in fp32 even in an fp64 model: fp32 tolerances.
    logits, hf_logits = model(idx)[0], hf(idx).logits
    torch.testing.assert_close(logits, hf_logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_overfits_one_batch(kind):
    model = make(kind)
    idx = tokens(4, 33)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    first = None
    for _ in range(40):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        first = first if first is not None else loss.item()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert loss.item() < 0.1 * first  # ~5.5 -> ~0.005 in practice


def test_a_trained_moe_gpt_can_be_copied_and_pickled():
    # After a training forward the aux losses hang on the graph; copies (the RL trainer's KL
    # reference model) and pickles must not carry them.
    import copy
    import io
    import pickle

    model = GPT(GPTConfig.tiny_moe())
    idx = torch.randint(0, 256, (2, 16))
    _, loss = model(idx, idx)
    loss.backward()
    assert model.aux_loss is not None and model.aux_loss.grad_fn is not None
    twin = copy.deepcopy(model)
    assert twin.aux_loss is None
    assert all(m.aux_loss is None for m in twin.modules() if isinstance(m, MoEBlock))
    assert model.aux_loss is not None  # the original keeps its last forward's value
    twin2 = pickle.loads(pickle.dumps(model))
    buf = io.BytesIO()
    torch.save(model, buf)
    for other in (twin, twin2):
        for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True):
            assert torch.equal(a, b)
        assert torch.equal(other(idx)[0], model(idx)[0])


def test_rope_tables_hold_rope_cos_sin_bits_through_casts_moves_and_meta():
    from fp4stack.models.rope import rope_cos_sin

    model = make(max_seq_len=64)
    c = model.config
    positions = torch.tensor([[0, 0, 0, 1, 2], [3, 17, 40, 41, 63]])  # pads clamp to 0
    want = rope_cos_sin(positions, c.head_size, c.rope_theta)
    inner = model.model

    def check(m):
        assert m.rope_cos.dtype == m.rope_sin.dtype == torch.float32
        assert torch.equal(m.rope_cos[positions], want[0])
        assert torch.equal(m.rope_sin[positions], want[1])

    check(inner)
    model.to(torch.bfloat16)  # weights cast, the tables remade in fp32
    check(inner)
    assert not any("rope" in k for k in model.state_dict())  # never in checkpoints
    # Built on meta, then weights assigned (as the Hugging Face importer does): the first
    # forward makes the tables on the tokens' device.
    with torch.device("meta"):
        lazy = GPT(model.config)
    lazy.load_state_dict(model.state_dict(), assign=True)
    assert lazy.model.rope_cos.is_meta
    x = tokens(s=8, vocab=c.vocab_size)
    assert torch.equal(lazy(x)[0], model(x)[0])
    check(lazy.model)
    # ... or moved with to_empty, which leaves weights to be filled but the tables made.
    with torch.device("meta"):
        empty = GPT(model.config)
    check(empty.to_empty(device="cpu").model)
