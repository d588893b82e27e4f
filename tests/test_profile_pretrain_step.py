"""benchmarks/profile_pretrain_step.py: the trainer's step, timed and profiled (CPU here)."""

from __future__ import annotations

import math

import torch
from scripts import ROOT, load_script

from fp4stack.train.config import load_config

prof = load_script("benchmarks/profile_pretrain_step.py")


def test_profiles_a_quantized_training_step_on_random_tokens():
    cfg = load_config(ROOT / "configs/pretrain/tiny.yaml", recipe="nvfp4",
                      global_batch_size=4, micro_batch_size=2, seq_len=32, device="cpu")
    r = prof.profile_recipe(cfg, 512, torch.device("cpu"), steps=1, warmup=1, top=50)
    assert r["recipe"] == "nvfp4" and r["tokens_per_step"] == 128
    assert len(r["wall_ms_all"]) == 1 and r["wall_ms"] > 0
    # Three steps (warm-up, timed, profiled) on random tokens: the loss stays near ln(vocab).
    assert math.isfinite(r["loss"]) and abs(r["loss"] - math.log(512)) < 1.0
    ops = {name: n for name, n, _ in r["cpu_ops"]}
    assert ops.get("_QuantLinearFn", 0) > 0  # the NVFP4 linears ran
    assert r["gpu_kernel_ms"] is None and r["gpu_busy"] is None and r["launches"] == 0
    report = prof.format_report([r]).splitlines()
    assert report[2].startswith("| nvfp4 | eager | ") and report[2].count("|") == 11
    assert report[2].split("|")[4].strip() == "-"  # no BF16 row to compare with
    assert r["peak_memory_gib"] is None and report[2].split("|")[10].strip() == "-"  # CPU


def test_compiled_mode_times_the_compiled_model_against_bf16_in_the_same_mode():
    cfg = load_config(ROOT / "configs/pretrain/tiny.yaml", recipe="bf16", global_batch_size=2,
                      micro_batch_size=2, seq_len=16, device="cpu")
    eager, compiled = (prof.profile_recipe(cfg, 512, torch.device("cpu"), steps=1, warmup=1,
                                           top=200, mode=m) for m in ("eager", "compiled"))
    assert (eager["mode"], compiled["mode"]) == ("eager", "compiled")
    # Same model, seed and tokens: the first steps' losses agree to rounding.
    assert abs(eager["loss"] - compiled["loss"]) < 1e-4 * abs(eager["loss"])
    ops = " ".join(name for name, _, _ in compiled["cpu_ops"])
    assert "CompiledFunction" in ops and "CompiledFunction" not in str(eager["cpu_ops"])
    # Ratios are against BF16 of the same mode.
    slower = [dict(r, recipe="nvfp4", wall_ms=r["wall_ms"] * f)
              for r, f in ((eager, 3.0), (compiled, 1.5))]
    lines = prof.format_report([eager, compiled, *slower]).splitlines()[2:6]
    assert [line.split("|")[4].strip() for line in lines] == ["1.00x", "1.00x", "3.00x", "1.50x"]


def test_entries_name_an_optimizer_as_compare_does(tmp_path, monkeypatch):
    out = tmp_path / "p.json"
    monkeypatch.setattr("sys.argv", [
        "profile_pretrain_step.py", "--config", str(ROOT / "configs/pretrain/tiny.yaml"),
        "--recipes", "bf16,bf16+root4", "--steps", "1", "--warmup", "1", "--top", "1",
        "--vocab-size", "256", "--device", "cpu", "--out", str(out), "--micro-batch-size", "4"])
    prof.main()
    import json
    rows = json.loads(out.read_text())["results"]
    assert [r["recipe"] for r in rows] == ["bf16", "bf16+root4"]
    assert [r["micro_batch_size"] for r in rows] == [4, 4]  # the config's is 16
    # Same seed and tokens: the timed step follows one update, by AdamW in one run and by
    # ROOT with NVFP4 states in the other, so the losses differ.
    assert rows[0]["loss"] != rows[1]["loss"]
