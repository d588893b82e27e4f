"""GRPO pieces against hand-computed values: advantages, rollout correction, clipped loss."""

import math

import pytest
import torch

from fp4stack.rl import group_advantages, grpo_loss, rollout_correction

NAN, INF = float("nan"), float("inf")
LN = math.log

# -- advantages -----------------------------------------------------------------------------------


def test_group_advantages_by_hand():
    eps = 1e-6
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 1.0, 2.0, 3.0],
                           dtype=torch.float64)
    adv = group_advantages(rewards, 4, eps=eps).tolist()
    # Group 0: mean 0.5, population std 0.5. Group 2: mean 1.5, variance (2.25+0.25)*2/4 = 1.25.
    want = [x / (0.5 + eps) for x in (0.5, -0.5, -0.5, 0.5)] + [0.0] * 4
    want += [x / (math.sqrt(1.25) + eps) for x in (-1.5, -0.5, 0.5, 1.5)]
    assert adv == pytest.approx(want, rel=1e-12)
    raw = group_advantages(rewards, 4, normalize_std=False).tolist()
    assert raw == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, -1.5, -0.5, 0.5, 1.5])


def test_flat_groups_get_exact_zeros():
    # In float64 the mean of (0.1, 0.1, 0.1) is not 0.1: without care a flat group would get
    # ~1e-17 / eps.
    for dtype in (torch.float32, torch.float64):
        rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7], dtype=dtype)
        for normalize in (True, False):
            assert group_advantages(rewards, 3, normalize_std=normalize).tolist() == [0.0] * 6
    assert group_advantages(torch.tensor([3.0, -1.0]), 1).tolist() == [0.0, 0.0]


def test_integer_rewards():
    adv = group_advantages(torch.tensor([1, 0, 1, 1]), 2)
    assert adv.dtype == torch.float32
    assert adv.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0], rel=1e-5)


@pytest.mark.parametrize("rewards, g, match", [
    (torch.zeros(6), 4, "multiple of group_size"),
    (torch.zeros(2, 4), 4, "1-D"),
    (torch.zeros(4), 0, "group_size"),
    (torch.tensor([1.0, NAN]), 2, "non-finite"),
])
def test_group_advantages_errors(rewards, g, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, g)


# -- rollout correction ---------------------------------------------------------------------------

# Per-token ratios r = exp(logp_old - logp_rollout); x marks padding.
#   row 0: 0.5, 3.0, x      w = 1.5
#   row 1: 1.5, 1.2, 1.1    w = 1.98
#   row 2: 0.4, 1.0, 1.0    w = 0.4
RATIOS = [[0.5, 3.0, None], [1.5, 1.2, 1.1], [0.4, 1.0, 1.0]]


def _rc_inputs():
    lr = torch.tensor([[-1.0, -2.0, NAN], [-0.5, -3.0, -1.0], [-0.2, -0.9, -4.0]],
                      dtype=torch.float64)
    old = lr.clone()
    mask = torch.ones(3, 3, dtype=torch.bool)
    for i, row in enumerate(RATIOS):
        for j, r in enumerate(row):
            if r is None:
                mask[i, j] = False
                old[i, j] = -INF
            else:
                old[i, j] = lr[i, j] + LN(r)
    return old, lr, mask


@pytest.mark.parametrize("mode, cap, want", [
    ("none", 2.0, [[1, 1, 0], [1, 1, 1], [1, 1, 1]]),
    ("token-tis", 2.0, [[0.5, 2.0, 0], [1.5, 1.2, 1.1], [0.4, 1, 1]]),
    ("token-mis", 2.0, [[0.5, 0.0, 0], [1.5, 1.2, 1.1], [0.4, 1, 1]]),
    ("token-mis", 1.3, [[0.5, 0.0, 0], [0.0, 1.2, 1.1], [0.4, 1, 1]]),
    ("seq-tis", 2.0, [[1.5, 1.5, 0], [1.98] * 3, [0.4] * 3]),
    ("seq-tis", 1.6, [[1.5, 1.5, 0], [1.6] * 3, [0.4] * 3]),
    ("seq-mis", 2.0, [[1, 1, 0], [1, 1, 1], [0, 0, 0]]),
    ("seq-mis", 1.6, [[1, 1, 0], [0, 0, 0], [0, 0, 0]]),
    ("seq-mis", 3.0, [[1, 1, 0], [1, 1, 1], [1, 1, 1]]),
])
def test_rollout_correction_modes(mode, cap, want):
    old, lr, mask = _rc_inputs()
    w = rollout_correction(old, lr, mask, mode=mode, cap=cap)
    assert w.dtype == old.dtype and w.shape == old.shape
    assert w.tolist() == [pytest.approx(row, rel=1e-12, abs=0) for row in want]


def test_rollout_correction_is_detached_and_at_least_float32():
    old, lr, mask = _rc_inputs()
    old = old.float().requires_grad_()
    for mode in ("none", "token-tis", "seq-tis"):
        assert not rollout_correction(old, lr.float(), mask, mode=mode).requires_grad
    w16 = rollout_correction(old.detach().bfloat16(), lr.bfloat16(), mask, mode="token-tis")
    assert w16.dtype == torch.float32


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "tis"}, "mode"),
    ({"mode": "token-tis", "cap": 0.0}, "cap"),
    ({"mode": "token-tis", "cap": -1.0}, "cap"),
    ({"mode": "seq-mis", "cap": 0.5}, "cap must be >= 1"),
])
def test_rollout_correction_argument_errors(kwargs, match):
    old, lr, mask = _rc_inputs()
    with pytest.raises(ValueError, match=match):
        rollout_correction(old, lr, mask, **kwargs)


def test_rollout_correction_shape_and_value_errors():
    old, lr, mask = _rc_inputs()
    with pytest.raises(ValueError, match="logp_rollout has shape"):
        rollout_correction(old, lr[:, :2], mask, mode="token-tis")
    with pytest.raises(ValueError, match="mask has shape"):
        rollout_correction(old, lr, mask[:2], mode="token-tis")
    lr[1, 1] = NAN
    with pytest.raises(ValueError, match="non-finite"):
        rollout_correction(old, lr, mask, mode="token-tis")


# -- loss -----------------------------------------------------------------------------------------

# Two sequences, the second with one response token. log(ratio) = ln 1.5, ln 0.9 | ln 0.5.
# A = (+1, -1), clip range [0.8, 1.2]. Per-token loss -min(r A, clip(r) A):
#   (0,0) r 1.5, A +1: -min(1.5, 1.2) = -1.2   clipped
#   (0,1) r 0.9, A +1: -min(0.9, 0.9) = -0.9
#   (1,0) r 0.5, A -1: -min(-0.5, -0.8) = 0.8  clipped
TOKENS = [-1.2, -0.9, 0.8]


def _tiny():
    old = torch.tensor([[-1.0, -2.0], [-0.5, -INF]], dtype=torch.float64)
    logp = old + torch.tensor([[LN(1.5), LN(0.9)], [LN(0.5), 0.0]], dtype=torch.float64)
    logp[1, 1] = NAN
    mask = torch.tensor([[1, 1], [1, 0]])
    return logp.requires_grad_(), old, torch.tensor([1.0, -1.0], dtype=torch.float64), mask


def test_loss_by_hand():
    logp, old, adv, mask = _tiny()
    loss, stats = grpo_loss(logp, old, adv, mask)
    assert loss.item() == pytest.approx(sum(TOKENS) / 3, rel=1e-12)
    assert stats == pytest.approx({"loss": sum(TOKENS) / 3, "clip_frac": 2 / 3,
                                   "ratio_mean": (1.5 + 0.9 + 0.5) / 3, "ratio_max": 1.5,
                                   "weight_mean": 1.0}, rel=1e-12)


def test_aggregations_by_hand():
    logp, old, adv, mask = _tiny()
    want = {"token-mean": sum(TOKENS) / 3,
            "seq-mean-token-mean": ((TOKENS[0] + TOKENS[1]) / 2 + TOKENS[2]) / 2,
            "seq-mean-token-sum": sum(TOKENS) / (2 * 2)}
    for agg, value in want.items():
        loss, stats = grpo_loss(logp, old, adv, mask, aggregation=agg)
        assert loss.item() == pytest.approx(value, rel=1e-12), agg
        assert stats["loss"] == pytest.approx(value, rel=1e-12)
    assert len({round(v, 12) for v in want.values()}) == 3


def test_weights_and_kl_by_hand():
    logp, old, adv, mask = _tiny()
    weights = torch.tensor([[0.5, 2.0], [1.0, 7.0]], dtype=torch.float64)  # 7.0 is padding
    deltas = [0.1, -0.2, 0.3]  # logp_ref - logp at the response tokens
    ref = logp.detach().clone()
    ref[0, 0] += deltas[0]
    ref[0, 1] += deltas[1]
    ref[1, 0] += deltas[2]
    k3 = [math.exp(x) - x - 1 for x in deltas]
    pg = [t * w for t, w in zip(TOKENS, (0.5, 2.0, 1.0), strict=True)]
    loss, stats = grpo_loss(logp, old, adv, mask, weights=weights, logp_ref=ref, kl_coef=0.1)
    assert loss.item() == pytest.approx((sum(pg) + 0.1 * sum(k3)) / 3, rel=1e-12)
    assert stats["kl"] == pytest.approx(sum(k3) / 3, rel=1e-12)
    assert stats["weight_mean"] == pytest.approx(3.5 / 3, rel=1e-12)
    # With kl_coef 0 the KL is still reported but does not enter the loss.
    loss0, stats0 = grpo_loss(logp, old, adv, mask, weights=weights, logp_ref=ref)
    assert loss0.item() == pytest.approx(sum(pg) / 3, rel=1e-12)
    assert stats0["kl"] == pytest.approx(sum(k3) / 3, rel=1e-12)
    assert "kl" not in grpo_loss(logp, old, adv, mask)[1]


def _random_batch(seed, b=4, t=6):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    mask = torch.rand(b, t, generator=g) < 0.7
    mask[:, 0] = True
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    weights = torch.rand(b, t, generator=g, dtype=torch.float64) + 0.5
    logp[~mask] = NAN
    return logp, mask, adv, weights


def test_gradient_without_clipping_is_minus_advantage_times_weight():
    logp, mask, adv, weights = _random_batch(0)
    logp.requires_grad_()
    loss, stats = grpo_loss(logp, logp.detach(), adv, mask, weights=weights)
    loss.backward()
    n = int(mask.sum())
    assert stats["clip_frac"] == 0.0 and stats["ratio_max"] == 1.0
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            want = -adv[i].item() * weights[i, j].item() / n if mask[i, j] else 0.0
            assert logp.grad[i, j].item() == pytest.approx(want, rel=1e-12, abs=1e-300)


def test_clipping_zeroes_gradient_where_expected():
    # Ratios 1.5 (above 1 + clip_high) and 0.5 (below 1 - clip_low), with A > 0 and A < 0.
    old = torch.zeros(2, 2, dtype=torch.float64)
    logp = torch.tensor([[LN(1.5), LN(0.5)], [LN(1.5), LN(0.5)]],
                        dtype=torch.float64).requires_grad_()
    adv = torch.tensor([2.0, -2.0], dtype=torch.float64)
    loss, stats = grpo_loss(logp, old, adv, torch.ones(2, 2))
    loss.backward()
    # A > 0, r 1.5: clipped, no gradient. A > 0, r 0.5: unclipped, -A r / n.
    # A < 0, r 1.5: unclipped, -A r / n. A < 0, r 0.5: clipped at 0.8, no gradient.
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, -2 * 0.5 / 4, 2 * 1.5 / 4, 0.0],
                                                         rel=1e-12)
    assert stats["clip_frac"] == 0.5
    # Asymmetric clipping (DAPO clip-higher): 1.5 is inside [0.8, 1.6], so it trains.
    logp.grad = None
    grpo_loss(logp, old, adv, torch.ones(2, 2), clip_high=0.6)[0].backward()
    assert logp.grad[0, 0].item() == pytest.approx(-2 * 1.5 / 4, rel=1e-12)


def test_kl_gradient_pulls_toward_reference():
    logp = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-0.5, -2.5, -3.0]], dtype=torch.float64)
    loss, _ = grpo_loss(logp, logp.detach(), torch.zeros(1, dtype=torch.float64),
                        torch.ones(1, 3), logp_ref=ref, kl_coef=0.5)
    loss.backward()
    g = logp.grad[0].tolist()
    # d/dlogp [e^x - x - 1] with x = ref - logp is 1 - e^x; descent moves logp toward ref.
    assert g[0] < 0 < g[1] and g[2] == 0.0
    assert g == pytest.approx([0.5 * (1 - math.exp(x)) / 3 for x in (0.5, -0.5, 0.0)], rel=1e-12)


def test_aggregations_match_loops_on_random_batch():
    logp, mask, adv, weights = _random_batch(1, b=5, t=7)
    mask[4] = False  # a sequence with no response token
    got = {agg: grpo_loss(logp, logp.detach(), adv, mask, weights=weights,
                          aggregation=agg)[0].item()
           for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")}
    # Ratio 1 everywhere: the token loss is -A_i w_ij.
    total, count, seq_means = 0.0, 0, []
    for i in range(5):
        toks = [-adv[i].item() * weights[i, j].item() for j in range(7) if mask[i, j]]
        total += sum(toks)
        count += len(toks)
        if toks:
            seq_means.append(sum(toks) / len(toks))
    assert got["token-mean"] == pytest.approx(total / count, rel=1e-12)
    assert got["seq-mean-token-mean"] == pytest.approx(sum(seq_means) / len(seq_means), rel=1e-12)
    assert got["seq-mean-token-sum"] == pytest.approx(total / (5 * 7), rel=1e-12)
    # With every token a response token the three agree.
    full = torch.ones(5, 7, dtype=torch.bool)
    lp = logp.nan_to_num(-1.0)
    vals = [grpo_loss(lp, lp, adv, full, weights=weights, aggregation=agg)[0].item()
            for agg in got]
    assert vals == pytest.approx([vals[0]] * 3, rel=1e-12)


def test_low_precision_logp():
    logp, mask, adv, _ = _random_batch(2)
    lp16 = logp.to(torch.bfloat16).requires_grad_()
    loss, _ = grpo_loss(lp16, lp16.detach(), adv, mask)
    loss.backward()
    assert loss.dtype == torch.float32 and lp16.grad.dtype == torch.bfloat16
    assert torch.isfinite(lp16.grad).all()


@pytest.mark.parametrize("change, match", [
    ({"logp_old": torch.zeros(2, 3)}, "logp_old has shape"),
    ({"advantages": torch.zeros(2, 1)}, "advantages must be"),
    ({"advantages": torch.zeros(3)}, "advantages must be"),
    ({"mask": torch.ones(2, 3)}, "mask has shape"),
    ({"mask": torch.zeros(2, 2)}, "no response tokens"),
    ({"weights": torch.ones(2)}, "weights has shape"),
    ({"logp_ref": torch.ones(1, 2)}, "logp_ref has shape"),
    ({"logp": torch.zeros(4)}, "logp must be"),
    ({"kl_coef": 0.1}, "needs logp_ref"),
    ({"kl_coef": -0.1}, "kl_coef"),
    ({"clip_low": 1.0}, "clip_low"),
    ({"clip_high": -0.1}, "clip_high"),
    ({"aggregation": "sum"}, "aggregation"),
])
def test_grpo_loss_errors(change, match):
    kwargs = {"logp": torch.zeros(2, 2), "logp_old": torch.zeros(2, 2),
              "advantages": torch.zeros(2), "mask": torch.ones(2, 2)}
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        grpo_loss(**kwargs)
