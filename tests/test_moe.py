"""MoE block: router top-k, grouped experts vs a naive per-token loop, aux loss, routing replay."""

import pytest
import torch
import torch.nn.functional as F

from fp4stack.nn.moe import (
    Experts,
    MoEBlock,
    Router,
    load_balance_loss,
    record_routing,
    replay_routing,
)

D, H, E, K = 16, 8, 5, 2


def make_block(dtype=torch.float64, seed=0, **kw) -> MoEBlock:
    torch.manual_seed(seed)
    return MoEBlock(D, H, E, K, **kw).to(dtype)


def naive_moe(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    """Per token, per chosen expert, straight from the definition."""
    probs = F.linear(x, block.router.gate.weight).softmax(-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        w, idx = probs[t].topk(K)
        w = w / w.sum()
        for j in range(K):
            e = int(idx[j])
            gu = block.experts.gate_up_proj[e] @ x[t]
            h = F.silu(gu[:H]) * gu[H:]
            out[t] += w[j] * (block.experts.down_proj[e] @ h)
    return out


def test_router_topk_weights_renormalised():
    torch.manual_seed(0)
    router = Router(D, E, K)
    x = torch.randn(32, D)
    weights, indices, logits = router(x)
    assert weights.shape == indices.shape == (32, K) and logits.shape == (32, E)
    torch.testing.assert_close(weights.sum(-1), torch.ones(32))
    top = logits.softmax(-1).topk(K)
    assert torch.equal(indices, top.indices)
    torch.testing.assert_close(weights, top.values / top.values.sum(-1, keepdim=True))
    raw, _, _ = Router(D, E, K, norm_topk_prob=False).to(torch.float32)(x)
    assert (raw.sum(-1) < 1).all()


def test_router_runs_fp32_under_bf16():
    router = Router(D, E, K).to(torch.bfloat16)
    x = torch.randn(8, D, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        weights, _, logits = router(x)
    assert logits.dtype == weights.dtype == torch.float32
    expected = F.linear(x.float(), router.gate.weight.float())
    torch.testing.assert_close(logits, expected)


def test_router_rejects_bad_top_k():
    with pytest.raises(ValueError, match="top_k"):
        Router(D, E, E + 1)


def test_grouped_experts_equal_naive_per_token():
    block = make_block()
    x = torch.randn(40, D, dtype=torch.float64)
    torch.testing.assert_close(block(x), naive_moe(block, x), rtol=1e-12, atol=1e-12)


def test_experts_layout_matches_transformers_qwen3_moe():
    modeling = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=H, num_experts=E,
                         num_experts_per_tok=K, norm_topk_prob=True,
                         experts_implementation="eager")
    block = make_block()
    hf = modeling.Qwen3MoeSparseMoeBlock(cfg).to(torch.float64)
    hf.experts.load_state_dict(block.experts.state_dict())
    hf.gate.weight.data.copy_(block.router.gate.weight)
    x = torch.randn(3, 7, D, dtype=torch.float64)
    # HF takes the router softmax in fp32 even for an fp64 model, hence fp32 tolerances.
    torch.testing.assert_close(block(x), hf(x), rtol=1e-5, atol=1e-7)


def test_gradients_reach_router_and_experts():
    block = make_block(torch.float32)
    x = torch.randn(64, D, requires_grad=True)
    (block(x).square().sum() + block.aux_loss).backward()
    for p in (block.router.gate.weight, block.experts.gate_up_proj, block.experts.down_proj):
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert x.grad.abs().sum() > 0
    # Every expert that received a token gets gradient.
    used = block.router(x)[1].unique()
    assert (block.experts.down_proj.grad[used].flatten(1).abs().sum(1) > 0).all()


def test_every_expert_matmul_goes_through_expert_linear():
    calls = []

    class Spy(Experts):
        def expert_linear(self, x, expert, which):
            calls.append((expert, which))
            return torch.zeros_like(super().expert_linear(x, expert, which))

    block = make_block(torch.float32)
    block.experts = Spy(D, H, E)
    x = torch.randn(30, D)
    assert block(x).abs().sum() == 0  # nothing bypasses the hook
    used = sorted(block.router(x)[1].unique().tolist())
    assert calls == [(e, w) for e in used for w in ("gate_up", "down")]  # only experts with tokens


def test_aux_loss_against_hand_formula():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 3.0], [1.0, -2.0, 0.0]])
    indices = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]])
    probs = logits.softmax(-1)
    T, n_e = logits.shape
    expected = 0.0
    for e in range(n_e):
        f = sum(int(e in row) for row in indices.tolist()) / T  # tokens routed to e
        p = sum(probs[t, e].item() for t in range(T)) / T  # mean router probability
        expected += f * p
    expected *= n_e
    assert load_balance_loss(logits, indices, n_e).item() == pytest.approx(expected, rel=1e-6)
    # Uniform probabilities and balanced assignment give k.
    uniform = load_balance_loss(torch.zeros(4, 4), torch.tensor([[0, 1], [2, 3]] * 2), 4)
    assert uniform.item() == pytest.approx(2.0)


@pytest.mark.parametrize("seed", range(4))
def test_aux_loss_of_the_real_tokens_is_the_loss_of_those_rows(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(20, 6, dtype=torch.float64, generator=g, requires_grad=True)
    indices = torch.randn(20, 6, generator=g).topk(2, dim=-1).indices
    real = torch.rand(20, generator=g) < 0.6
    masked = load_balance_loss(logits, indices, 6, real)
    rows = load_balance_loss(logits[real], indices[real], 6)
    torch.testing.assert_close(masked, rows, rtol=1e-12, atol=0)
    (g_masked,), (g_rows,) = (torch.autograd.grad(v, logits) for v in (masked, rows))
    torch.testing.assert_close(g_masked, g_rows, rtol=1e-12, atol=1e-15)
    assert g_masked[~real].abs().max() == 0  # pads get no gradient
    everything = load_balance_loss(logits, indices, 6, torch.ones(20, dtype=torch.bool))
    torch.testing.assert_close(everything, load_balance_loss(logits, indices, 6), rtol=1e-12,
                               atol=0)
    assert load_balance_loss(logits, indices, 6, torch.zeros(20, dtype=torch.bool)) == 0


def test_block_stores_aux_loss():
    block = make_block()
    x = torch.randn(20, D, dtype=torch.float64)
    block(x)
    _, idx, logits = block.router(x)
    torch.testing.assert_close(block.aux_loss, load_balance_loss(logits, idx, E))


def test_replay_same_routing_reproduces_output():
    block = make_block()
    x = torch.randn(2, 9, D, dtype=torch.float64)
    with record_routing(block) as routing:
        y = block(x)
    assert set(routing) == {""} and routing[""].shape == (2, 9, K)
    with replay_routing(block, routing):
        y_replay = block(x)
    assert torch.equal(y, y_replay)
    assert block.replay_indices is None  # cleared on exit


def test_replay_forces_exactly_the_given_experts():
    block = make_block()
    x = torch.randn(12, D, dtype=torch.float64)
    natural = block.router(x)[1]
    forced = (natural + 1) % E  # a different, still distinct, pair of experts per token
    block.replay_indices = forced
    with record_routing(block) as routing:
        y_forced = block(x)
    block.replay_indices = None
    assert torch.equal(routing[""], forced)
    assert not torch.allclose(y_forced, block(x))
    # Weights: this router's own probabilities at the forced experts, renormalised.
    probs = block.router(x)[2].softmax(-1).gather(-1, forced)
    weights, idx, _ = block.router(x, forced)
    assert torch.equal(idx, forced)
    torch.testing.assert_close(weights, probs / probs.sum(-1, keepdim=True))


def test_replay_gives_router_gradient():
    block = make_block(torch.float32)
    x = torch.randn(16, D)
    first = torch.randint(0, E, (16,))
    block.replay_indices = torch.stack((first, (first + 1) % E), dim=-1)
    block(x).sum().backward()
    assert block.router.gate.weight.grad.abs().sum() > 0


def test_record_concatenates_consecutive_chunks_along_sequence():
    block = make_block()
    x = torch.randn(2, 10, D, dtype=torch.float64)
    with record_routing(block) as whole:
        block(x)
    with record_routing(block) as chunked:
        block(x[:, :6])
        block(x[:, 6:])
    assert torch.equal(whole[""], chunked[""])


def test_replay_errors():
    block = make_block()
    block.replay_indices = torch.zeros(3, K, dtype=torch.long)
    with pytest.raises(ValueError, match="replay_indices has shape"):
        block(torch.randn(4, D, dtype=torch.float64))
    bad = {"x": torch.zeros(4, K)}
    with pytest.raises(ValueError, match="missing"), replay_routing(block, bad):
        pass


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("n_experts", [1, 8, 256, 257, 40_000])
@pytest.mark.parametrize("pairs", [0, 1, 512, 5_000])
def test_expert_order_is_the_stable_int64_argsort(n_experts, pairs, device):
    from fp4stack.kernels.expert_order import expert_order

    g = torch.Generator().manual_seed(pairs + n_experts)
    flat = torch.randint(0, n_experts, (pairs,), generator=g).to(device)
    flat[: pairs // 3] = n_experts - 1  # long runs of one expert: stability decides their order
    assert torch.equal(expert_order(flat, n_experts), torch.argsort(flat, stable=True))
