"""experiments/quads_claims.py: the claims computed from a comparison's rows, over seeds."""

from __future__ import annotations

import json

import pytest
import quads_claims


def row(run: str, seed: int, start: float, final: float, k3: float, dlogp: float) -> dict:
    return {"run": run, "seed": seed, "steps": 300, "start_pass_at_1": start,
            "final_pass_at_1": final, "k3_mean": k3, "dlogp_max_mean": dlogp}


ROWS = [row("bf16", 0, 0.40, 0.60, 0.0, 0.70), row("bf16", 1, 0.40, 0.64, 0.0, 0.72),
        row("nvfp4", 0, 0.40, 0.50, 0.9, 1.30), row("nvfp4", 1, 0.40, 0.56, 0.7, 1.20),
        row("quads@0.5", 0, 0.40, 0.615, 0.2, 0.90), row("quads@0.5", 1, 0.40, 0.625, 0.2, 0.92),
        row("quads@0.25", 0, 0.40, 0.55, 0.3, 1.0)]


def test_claims_average_the_seeds_and_pick_the_best_quads_arm():
    table = quads_claims.claims(ROWS)
    assert [c["holds"] for c in table] == [True, True, True, True, True]
    assert table[0]["claim"].endswith("(seeds 0, 1)")
    assert table[0]["here"] == "9.0 points below (per seed 10.0, 8.0)"  # 0.62 - 0.53
    assert table[1]["claim"].startswith("quads@0.5 ")  # 0.62 beats quads@0.25's 0.55
    assert table[1]["here"] == "0.0 points below (per seed -1.5, 1.5)"
    assert table[2]["here"] == "0.710 < 0.910 < 1.250"
    assert table[3]["here"] == "4.00x below"  # mean k3 0.8 against 0.2
    # The ratio arms share seed 0 only: quads@0.5's seed 1 stays out of the sweep.
    assert table[4]["claim"].startswith("max abs dlogp falls as the compensated ratio grows "
                                        "(25% / 50%")
    assert table[4]["claim"].endswith(", seed 0)")
    assert (table[4]["paper"], table[4]["here"]) == ("0.901 > 0.854", "1.000 > 0.900")


def test_arms_are_compared_over_the_seeds_they_share():
    # quads@0.25 has seed 0 only: BF16 and naive NVFP4 are read at seed 0 too, not averaged
    # over seeds the QUADS arm never ran.
    table = quads_claims.claims(ROWS, quads="quads@0.25")
    assert all(c["claim"].endswith("(seed 0)") for c in table[:4])
    assert table[0]["here"] == "10.0 points below"  # 0.60 - 0.50; over both seeds: 9.0
    assert table[2]["here"] == "0.700 < 1.000 < 1.300"
    assert table[3]["here"] == "3.00x below"
    lone = [*ROWS, row("quads@1", 2, 0.40, 0.70, 0.1, 0.8)]
    with pytest.raises(ValueError, match="share no seed"):
        quads_claims.claims(lone, quads="quads@1")


def test_the_ratio_claim_takes_the_mode_with_most_ratios_and_can_fail():
    rows = [*ROWS, row("quads@0.125:static", 0, 0.4, 0.5, 0.5, 2.0),
            row("quads@0.5:static", 0, 0.4, 0.5, 0.5, 2.5),
            row("quads@1:static", 0, 0.4, 0.5, 0.5, 1.5),
            row("quads-token@0.25:static", 0, 0.4, 0.5, 0.5, 0.1),  # per-token: another method
            row("quads@0.25:static+tis", 0, 0.4, 0.5, 0.5, 0.1)]  # a correction: left out
    ratios = quads_claims.claims(rows)[4]
    assert ratios["claim"].endswith("(12.5% / 50% / 100%, static, seed 0)")
    assert ratios["here"] == "2.000 > 2.500 > 1.500"
    assert ratios["paper"] == "0.923 > 0.854 > 0.759"
    assert ratios["holds"] is False
    one_ratio = [r for r in ROWS if r["run"] != "quads@0.25"]
    assert len(quads_claims.claims(one_ratio)) == 4  # no ratio claim from one ratio


def test_the_w4a16_ablation_compares_the_quads_arm_over_shared_seeds():
    rows = [*ROWS, row("w4a16", 0, 0.40, 0.60, 0.01, 0.75)]
    ablation = quads_claims.claims(rows)[-1]
    assert ablation["claim"] == ("quads@0.5 ends at or above the W4A16 rollout's pass@1 "
                                 "(seed 0)")
    assert ablation["paper"] == "1.8 points above (71.1 -> 72.9)"
    assert (ablation["here"], ablation["holds"]) == ("+1.5 points", True)  # 0.615 - 0.60
    below = quads_claims.claims([*ROWS, row("w4a16", 0, 0.40, 0.62, 0.01, 0.75)])[-1]
    assert (below["here"], below["holds"]) == ("-0.5 points", False)
    # No shared seed, or no w4a16 run: no such row.
    assert len(quads_claims.claims([*ROWS, row("w4a16", 5, 0.4, 0.6, 0.0, 0.7)])) == 5
    assert len(quads_claims.claims(ROWS)) == 5


def test_a_named_arm_and_claims_that_fail():
    table = quads_claims.claims(ROWS, quads="quads@0.25")
    assert [c["holds"] for c in table] == [True, False, True, True, True]
    assert table[1]["here"] == "5.0 points below"
    weak = [*ROWS, row("quads@0.125", 0, 0.40, 0.45, 0.5, 1.1)]
    table = quads_claims.claims(weak, quads="quads@0.125")
    assert [c["holds"] for c in table] == [True, False, True, False, True]


def test_missing_runs_are_named(tmp_path, capsys):
    with pytest.raises(KeyError, match="no 'nvfp4' run"):
        quads_claims.claims([r for r in ROWS if r["run"] != "nvfp4"])
    with pytest.raises(KeyError, match="no 'quads@1' run"):
        quads_claims.claims(ROWS, quads="quads@1")
    path = tmp_path / "rl_compare.json"
    path.write_text(json.dumps(ROWS[:2]))
    assert quads_claims.main([str(path)]) == 2
    assert "no 'nvfp4' run" in capsys.readouterr().err
    path.write_text(json.dumps([*ROWS, row("quads@1", 2, 0.40, 0.70, 0.1, 0.8)]))
    assert quads_claims.main([str(path), "--quads", "quads@1"]) == 2
    assert "share no seed" in capsys.readouterr().err
    path.write_text(json.dumps(ROWS))
    assert quads_claims.main([str(path)]) == 0
    assert "| naive NVFP4 ends >= 5 points" in capsys.readouterr().out
