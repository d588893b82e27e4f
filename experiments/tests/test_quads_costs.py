"""experiments/quads_costs.py: a comparison's runs beside the engine's speed for their rollout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import quads_costs

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks/results/bench_rollout_smollm2_moe_h100_2026-12-05.json"


def row(run, rollout, seed=0, compensation=0.05, mode="dynamic", final=0.6, k3=1e-2, **more):
    return {"run": run, "seed": seed, "steps": 300, "rollout": rollout,
            "compensation": compensation, "compensation_mode": mode, "start_pass_at_1": 0.4,
            "final_pass_at_1": final, "k3_mean": k3, "dlogp_max_mean": 1.0, **more}


REPORT = [row("bf16", "bf16"), row("bf16", "bf16", seed=1, final=0.7),
          row("quads@0.5", "quads", compensation=0.5),
          row("quads@0.5:static", "quads", compensation=0.5, mode="static"),
          row("quads@0.25", "quads", compensation=0.25),
          row("nvfp4-token/qat-w", "nvfp4-token"),
          row("w4a16 four_over_six=True", "w4a16", four_over_six=True)]


def test_runs_take_the_speed_of_their_precision_fraction_and_mode():
    speeds = quads_costs.engine_speeds([json.loads(BENCH.read_text())])
    table = {r["run"]: r for r in quads_costs.cost_table(REPORT, speeds)}
    assert table["bf16"]["vs_bf16"] == 1.0 and table["bf16"]["seeds"] == 2
    assert table["bf16"]["pass_at_1"] == pytest.approx(0.65)  # the mean over its seeds
    assert round(table["quads@0.5"]["tokens_per_s"]) == 11424  # dynamic channels
    assert round(table["quads@0.5:static"]["tokens_per_s"]) == 13140
    assert round(table["nvfp4-token/qat-w"]["tokens_per_s"]) == 17672
    assert table["quads@0.25"]["tokens_per_s"] is None  # no engine row at that fraction
    assert table["w4a16 four_over_six=True"]["tokens_per_s"] is None  # nor with those scales
    text = quads_costs.format_table(list(table.values()))
    assert "| quads@0.25 | 1 | not measured |" in text
    assert "| quads@0.5 | 1 | 11,424 | 0.53x |" in text


def test_the_command_prints_the_table(tmp_path, capsys):
    report = tmp_path / "rl_compare.json"
    report.write_text(json.dumps(REPORT))
    assert quads_costs.main([str(report), str(BENCH)]) == 0
    assert "| nvfp4-token/qat-w | 1 | 17,672 | 0.82x |" in capsys.readouterr().out


def test_four_over_six_runs_take_the_speed_of_their_own_engine_rows():
    bench = json.loads(BENCH.read_text())
    plain = next(r for r in bench["rows"] if r["engine"] == "fast" and r["precision"] == "w4a16")
    four_six = {"rows": [{**plain, "four_over_six": True, "tokens_per_s": 1234.0},
                         next(r for r in bench["rows"]
                              if r["engine"] == "fast" and r["precision"] == "bf16")]}
    speeds = quads_costs.engine_speeds([bench, four_six])
    report = REPORT + [row("w4a16", "w4a16")]
    table = {r["run"]: r for r in quads_costs.cost_table(report, speeds)}
    assert table["w4a16 four_over_six=True"]["tokens_per_s"] == 1234.0
    plain_speed = quads_costs.engine_speeds([bench])["w4a16", None, None, False][0]
    assert table["w4a16"]["tokens_per_s"] == plain_speed != 1234.0
