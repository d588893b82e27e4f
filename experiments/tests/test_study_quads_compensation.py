"""study_quads_compensation on the tiny policy: the rows in order, the engines that compute the
trainer's function exactly (BF16 against BF16, QUADS with every channel against qat-w) at zero
mismatch, and static channels (fixed by calibration) beside the dynamic ones."""

import json
import sys

import study_quads_compensation


def test_rows_per_precision_share_and_mode(tmp_path, monkeypatch):
    out = tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", [
        "study_quads_compensation.py", "--config", "configs/rl/tiny.yaml", "--cache",
        str(tmp_path / "sft"), "--sft-steps", "3", "--max-new-tokens", "3", "--prompts", "4",
        "--group", "2", "--fractions", "0.25,1.0", "--modes", "dynamic,static",
        "--json", str(out)])
    study_quads_compensation.main()
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["group"] == 2
    quads = [(r["rollout"], r["compensation"], r["mode"]) for r in rows[7:]]
    assert quads == [(p, k, m) for p in ("quads", "quads-token") for m in ("dynamic", "static")
                     for k in (0.25, 1.0)]
    assert rows[0]["rollout"] == "bf16" and rows[0]["logp_diff_max"] == 0.0
    for r in rows[7:]:
        if r["compensation"] == 1.0:  # every channel corrected: W4A16, the qat-w trainer's
            assert r["k3"] < 1e-9 and r["logp_diff_max"] < 1e-5, r
        else:
            assert r["logp_diff_max"] > 0.0, r
