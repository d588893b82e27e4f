"""Trainer-rollout mismatch metrics and the mismatch alarm, against plain-Python loops."""

import math
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fp4stack.rl import MismatchAlarm, MismatchAlarmError, mismatch_metrics
from fp4stack.rl.metrics import METRIC_KEYS

NAN, INF = float("nan"), float("inf")


def _expected(lp_rows, lq_rows):
    """Every metric by loops over lists of per-sequence response log-probs (no padding)."""
    ds, abs_d, pdiff, seq_sums, geos = [], [], [], [], []
    for lp_row, lq_row in zip(lp_rows, lq_rows, strict=True):
        s = 0.0
        for a, b in zip(lp_row, lq_row, strict=True):
            ds.append(a - b)
            abs_d.append(abs(a - b))
            pdiff.append(abs(math.exp(a) - math.exp(b)))
            s += a - b
        if lp_row:
            seq_sums.append(s)
            geos.append(math.exp(s / len(lp_row)))
    n, ns = len(ds), len(seq_sums)
    w = [math.exp(s) for s in seq_sums]
    w_mean = sum(w) / ns
    return {
        "k1": sum(-d for d in ds) / n,
        "k2": 0.5 * sum(d * d for d in ds) / n,
        "k3": sum(math.exp(d) - 1 - d for d in ds) / n,
        "logp_diff_mean": sum(abs_d) / n,
        "logp_diff_max": max(abs_d),
        "prob_diff_mean": sum(pdiff) / n,
        "prob_diff_max": max(pdiff),
        "chi2_token": sum(math.exp(d) ** 2 for d in ds) / n - 1,
        "chi2_seq": sum(x * x for x in w) / ns - 1,
        "ess": 1 / (sum((x / w_mean) ** 2 for x in w) / ns),
        "seq_ratio_max": max(w),
        "seq_ratio_min": min(w),
        "geo_ratio_mean": sum(geos) / ns,
        "n_tokens": n,
    }


# Three sequences of lengths 3, 1, 2 (padded to 4), and one with no response token at all.
LP = [[-0.5, -1.2, -2.0], [-0.1], [-3.0, -0.7]]
LQ = [[-0.6, -1.0, -2.5], [-0.3], [-2.9, -0.7]]
GARBAGE = [NAN, -INF, INF, 7.0]


def _padded(rows, width=4, n_empty=1):
    out, mask = [], []
    for row in rows + [[]] * n_empty:
        pad = GARBAGE[: width - len(row)]
        out.append(row + pad)
        mask.append([1] * len(row) + [0] * len(pad))
    return torch.tensor(out, dtype=torch.float64), torch.tensor(mask, dtype=torch.bool)


def test_every_formula_matches_loops():
    lp, mask = _padded(LP)
    lq, _ = _padded(LQ)
    got = mismatch_metrics(lp, lq, mask)
    want = _expected(LP, LQ)
    assert tuple(got) == METRIC_KEYS
    for k in METRIC_KEYS:
        assert got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-15), k
    assert got["n_tokens"] == 6 and isinstance(got["n_tokens"], int)


def test_padding_values_are_ignored():
    lp, mask = _padded(LP)
    lq, _ = _padded(LQ)
    base = mismatch_metrics(lp, lq, mask)
    lp2, lq2 = lp.clone(), lq.clone()
    lp2[~mask] = 123.0
    lq2[~mask] = -INF
    assert mismatch_metrics(lp2, lq2, mask) == base


def test_identical_logprobs_mean_no_mismatch():
    lp, mask = _padded(LP)
    m = mismatch_metrics(lp, lp.clone(), mask)
    for k in ("k1", "k2", "k3", "logp_diff_mean", "logp_diff_max", "prob_diff_mean",
              "prob_diff_max", "chi2_token", "chi2_seq"):
        assert m[k] == 0.0, k
    for k in ("ess", "seq_ratio_max", "seq_ratio_min", "geo_ratio_mean"):
        assert m[k] == 1.0, k


@pytest.mark.parametrize("s", [300.0, 400.0, 800.0])
def test_ess_is_exact_for_huge_sequence_log_ratios(s):
    # Sequence log-ratios +s, -s and s - ln 3 (3 tokens each): w ~ (e^s, e^-s, e^s / 3), so
    # ess = (sum w)^2 / (n sum w^2) = (4/3)^2 / (3 (1 + 1/9)) = 16/30 up to e^-2s.
    per = s / 3
    d = torch.tensor([[per] * 3, [-per] * 3, [(s - math.log(3)) / 3] * 3], dtype=torch.float64)
    lq = torch.full((3, 3), -1000.0, dtype=torch.float64)
    m = mismatch_metrics(lq + d, lq, torch.ones(3, 3))
    assert m["ess"] == pytest.approx(16 / 30, rel=1e-12)
    assert m["seq_ratio_min"] == pytest.approx(math.exp(-s), rel=1e-9, abs=1e-300)
    # chi2_seq = e^2s (1 + 1/9) / 3 - 1 and seq_ratio_max = e^s overflow only past float64.
    if 2 * s < 709:
        assert m["chi2_seq"] == pytest.approx(math.exp(2 * s) * 10 / 27, rel=1e-9)
    else:
        assert m["chi2_seq"] == INF
    if s < 709:
        assert m["seq_ratio_max"] == pytest.approx(math.exp(s), rel=1e-9)
    else:
        assert m["seq_ratio_max"] == INF
    assert math.isfinite(m["k1"]) and math.isfinite(m["geo_ratio_mean"])


def test_low_precision_inputs_and_integer_mask():
    lp, mask = _padded(LP)
    lq, _ = _padded(LQ)
    lp16, lq16 = lp.to(torch.bfloat16), lq.to(torch.bfloat16)
    got = mismatch_metrics(lp16, lq16, mask.to(torch.int64))
    want = mismatch_metrics(lp16.double(), lq16.double(), mask)
    assert got == want


def test_k1_and_k3_agree_and_k2_is_their_second_order():
    # Tokens "sampled" from q in exact proportions: the token mean is then the expectation under
    # q, where k1 and k3 are both exactly KL(q || p). k2 = E_q[d^2] / 2 matches it to O(eps^3).
    q = [0.1, 0.2, 0.3, 0.4]
    eps = 1e-2
    shift = [eps, -eps, 0.5 * eps, -0.25 * eps]
    z = sum(qi * math.exp(si) for qi, si in zip(q, shift, strict=True))
    p = [qi * math.exp(si) / z for qi, si in zip(q, shift, strict=True)]
    lp, lq = [], []
    for qi, pi in zip(q, p, strict=True):
        lp += [math.log(pi)] * round(qi * 10)
        lq += [math.log(qi)] * round(qi * 10)
    m = mismatch_metrics(torch.tensor([lp], dtype=torch.float64),
                         torch.tensor([lq], dtype=torch.float64), torch.ones(1, len(lp)))
    kl = sum(qi * math.log(qi / pi) for qi, pi in zip(q, p, strict=True))
    assert m["k1"] == pytest.approx(kl, rel=1e-9)
    assert m["k3"] == pytest.approx(kl, rel=1e-9)
    assert m["k2"] == pytest.approx(kl, rel=10 * eps)


def test_small_d_k3_equals_k2_to_second_order():
    g = torch.Generator().manual_seed(0)
    lq = -torch.rand(8, 16, generator=g, dtype=torch.float64) * 3
    for scale in (1e-2, 1e-3):
        d = torch.randn(8, 16, generator=g, dtype=torch.float64) * scale
        m = mismatch_metrics(lq + d, lq, torch.ones(8, 16))
        half_d2 = 0.5 * sum(x * x for x in d.flatten().tolist()) / d.numel()
        assert m["k2"] == pytest.approx(half_d2, rel=1e-9)
        # k3 - k2 = mean(d^3 / 6 + ...): relative gap of order max|d|.
        assert m["k3"] == pytest.approx(half_d2, rel=5 * scale)


_logp = st.floats(-20.0, 0.0, allow_nan=False)


@given(st.data())
def test_divergence_estimates_are_nonnegative(data):
    rows, width = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 6))
    n = rows * width
    lp = torch.tensor(data.draw(st.lists(_logp, min_size=n, max_size=n)), dtype=torch.float64)
    lq = torch.tensor(data.draw(st.lists(_logp, min_size=n, max_size=n)), dtype=torch.float64)
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    lp, lq, mask = lp.view(rows, width), lq.view(rows, width), mask.view(rows, width)
    mask[0, 0] = True
    m = mismatch_metrics(lp, lq, mask)
    assert m["k3"] >= 0 and m["k2"] >= 0
    # chi2 is not sign-definite per sample (only E_q[r] = 1 makes it so), hence only > -1.
    assert m["chi2_token"] >= -1 and m["chi2_seq"] >= -1
    assert 0 < m["ess"] <= 1
    assert m["logp_diff_max"] >= m["logp_diff_mean"] >= 0


@pytest.mark.parametrize("lp, lq, mask, match", [
    (torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), "lp and lq"),
    (torch.zeros(3), torch.zeros(3), torch.ones(3), "lp and lq"),
    (torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 4), "mask has shape"),
    (torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), "no response tokens"),
    (torch.zeros(2, 3), torch.zeros(2, 3), torch.full((2, 3), 2), "only 0 and 1"),
    (torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3), torch.ones(2, 3), "float"),
    (torch.tensor([[0.0, NAN]]), torch.zeros(1, 2), torch.ones(1, 2), "lp has non-finite"),
    (torch.zeros(1, 2), torch.tensor([[-INF, 0.0]]), torch.ones(1, 2), "lq has non-finite"),
])
def test_invalid_inputs_raise(lp, lq, mask, match):
    with pytest.raises(ValueError, match=match):
        mismatch_metrics(lp, lq, mask)


# -- alarm ----------------------------------------------------------------------------------------

def test_alarm_warns_and_returns_message():
    alarm = MismatchAlarm(metric="k3", threshold=0.01)
    assert alarm.check(1, {"k3": 0.005}) is None
    with pytest.warns(RuntimeWarning, match="step 2") as rec:
        msg = alarm.check(2, {"k3": 0.02})
    assert msg is not None and str(rec[0].message) == msg
    for part in ("k3", "0.02", "0.01", "threshold"):
        assert part in msg


def test_alarm_patience_needs_consecutive_checks():
    alarm = MismatchAlarm(threshold=1.0, patience=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert alarm.check(1, {"k3": 2.0}) is None
        assert alarm.check(2, {"k3": 2.0}) is None
        assert alarm.check(3, {"k3": 0.5}) is None  # resets the streak
        assert alarm.check(4, {"k3": 2.0}) is None
        assert alarm.check(5, {"k3": 2.0}) is None
    with pytest.warns(RuntimeWarning):
        assert "step 6" in alarm.check(6, {"k3": 2.0})
    with pytest.warns(RuntimeWarning):
        assert alarm.check(7, {"k3": 3.0}) is not None  # still in the streak


def test_alarm_stop_raises_with_details():
    alarm = MismatchAlarm(metric="chi2_seq", threshold=0.5, action="stop", patience=2)
    assert alarm.check(10, {"chi2_seq": 0.9}) is None
    with pytest.raises(MismatchAlarmError) as exc:
        alarm.check(11, {"chi2_seq": 0.75})
    assert isinstance(exc.value, RuntimeError)
    text = str(exc.value)
    for part in ("step 11", "chi2_seq", "0.75", "0.5", "threshold", "action='warn'"):
        assert part in text


def test_alarm_on_ess_fires_below_threshold_and_on_nan():
    alarm = MismatchAlarm(metric="ess", threshold=0.5, action="stop")
    assert alarm.check(1, {"ess": 0.9}) is None
    with pytest.raises(MismatchAlarmError, match="below"):
        alarm.check(2, {"ess": 0.3})
    with pytest.raises(MismatchAlarmError):
        MismatchAlarm(action="stop").check(3, {"k3": NAN})


def test_alarm_works_on_real_metrics():
    lp, mask = _padded(LP)
    lq, _ = _padded(LQ)
    m = mismatch_metrics(lp, lq, mask)
    with pytest.raises(MismatchAlarmError):
        MismatchAlarm(threshold=m["k3"] / 2, action="stop").check(1, m)
    assert MismatchAlarm(threshold=m["k3"] * 2, action="stop").check(1, m) is None


@pytest.mark.parametrize("kwargs, field", [
    ({"metric": ""}, "metric"),
    ({"metric": 3}, "metric"),
    ({"threshold": NAN}, "threshold"),
    ({"threshold": "0.1"}, "threshold"),
    ({"action": "crash"}, "action"),
    ({"patience": 0}, "patience"),
    ({"patience": 1.5}, "patience"),
    ({"patience": True}, "patience"),
])
def test_alarm_argument_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        MismatchAlarm(**kwargs)


def test_alarm_missing_metric():
    with pytest.raises(ValueError, match="no 'k3'"):
        MismatchAlarm().check(1, {"k1": 0.0})
