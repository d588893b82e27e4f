"""study_sft_start on the tiny policy: one row per (warm-up recipe, rollout precision), the BF16
engine's mismatch against the float32 policy exactly zero on the CPU, and the recipes' starts
differing."""

import json
import sys

import study_sft_start


def test_rows_per_recipe_and_precision(tmp_path, monkeypatch):
    out = tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", [
        "study_sft_start.py", "--config", "configs/rl/tiny.yaml", "--levels", "1",
        "--sft-steps", "3", "--sft-recipes", "bf16,qat-w", "--precisions", "bf16,nvfp4,quads@0.5",
        "--prompts", "4", "--group", "2", "--max-new-tokens", "3", "--out", str(out)])
    study_sft_start.main()
    rows = json.loads(out.read_text())
    assert [(r["sft_recipe"], r["rollout"]) for r in rows] == [
        (rec, p) for rec in ("bf16", "qat-w") for p in ("bf16", "nvfp4", "quads@0.5")]
    by = {(r["sft_recipe"], r["rollout"]): r for r in rows}
    for recipe in ("bf16", "qat-w"):
        assert by[recipe, "bf16"]["dlogp_max"] == 0.0  # the engine is the policy on the CPU
        assert by[recipe, "nvfp4"]["dlogp_max"] > 0.0
        assert "mixed_groups" in by[recipe, "bf16"] and "mixed_groups" not in by[recipe, "nvfp4"]
        assert all(0.0 <= by[recipe, p]["greedy_pass1"] <= 1.0 for p in ("bf16", "nvfp4"))
    assert by["bf16", "nvfp4"]["completion_nll"] != by["qat-w", "nvfp4"]["completion_nll"]


def test_the_probe_configs_load():
    from fp4stack.rl.config import load_rl_config

    dense = load_rl_config("experiments/configs/smollm2_dense_sft_probe.yaml")
    assert dense.upcycle is None and dense.sft_recipe == "bf16" and dense.device == "cpu"
    moe = load_rl_config("experiments/configs/smollm2_moe_sft_probe.yaml")
    assert moe.upcycle == {"n_experts": 8, "top_k": 2, "expert_noise": 0.01}
    assert {k: v for k, v in vars(moe).items() if k not in ("upcycle", "out")} == {
        k: v for k, v in vars(dense).items() if k not in ("upcycle", "out")}
