"""benchmarks/profile_rl_step.py: a GRPO step's phases timed and the trainer's update profiled
(CPU here, on the tiny MoE policy)."""

from __future__ import annotations

import torch
from scripts import load_script

from fp4stack.rl.config import RLConfig
from fp4stack.rl.start import build_run, start_engine

prof = load_script("benchmarks/profile_rl_step.py")


def test_times_every_phase_and_profiles_the_update_per_micro_batch_size(tmp_path):
    cfg = RLConfig(policy={"kind": "gpt", "preset": "tiny-moe", "moe_hidden": 64},
                   task="arithmetic:worked", task_options={"level": 1, "n_test": 4},
                   sft_steps=2, rollout="nvfp4", trainer="bf16", prompts_per_step=4,
                   group_size=2, micro_batch_size=4, max_new_tokens=6, device="cpu")
    device = torch.device("cpu")
    parts = build_run(cfg, device, tmp_path, log=lambda *a: None)
    start_engine(cfg, parts, log=lambda *a: None)
    steps, rollout, adv = prof.time_steps(cfg, parts, device, steps=2)
    assert len(steps) == 2 and rollout.tokens.shape[0] == 8 and adv.shape == (8,)
    for t in steps:
        assert set(prof.PHASES) <= set(t) and t["generate"] > 0 and t["train"] > 0
    assert steps[-1]["tokens"] == int(rollout.mask.sum())
    small, large = (prof.profile_train_step(cfg, parts, rollout, adv, device, m, top=5)
                    for m in (2, 8))
    # Four micro-batches run the model four times: more op calls than one of eight rows.
    assert small["aten_calls"] > 2 * large["aten_calls"] > 0
    assert small["gpu_kernel_ms"] is None and small["launches"] == 0 and small["peak_gib"] is None
    report = prof.format_report(steps, [small, large]).splitlines()
    assert [line.split("|")[1].strip() for line in report[2:8]] == [*prof.PHASES, "step"]
    assert report[-2].startswith("| 2 | ") and report[-1].startswith("| 8 | ")
