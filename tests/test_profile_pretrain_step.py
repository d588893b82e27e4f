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
    assert report[2].startswith("| nvfp4 | ") and report[2].count("|") == 8
