"""`compare --jobs` and `rl-compare --jobs`: runs in their own processes give the results of the
same runs one after another, bit for bit; each writes its output to its log; a failed run is
named while the others finish."""

from __future__ import annotations

import json

import pytest
import torch
from test_compare import setup  # noqa: F401 (the tiny pretraining config, a fixture)
from test_rl import tiny_config

from fp4stack.parallel_runs import Job, RunsFailedError, run_jobs
from fp4stack.rl.compare import run_rl_comparison
from fp4stack.train.compare import run_comparison


def square(x: int) -> int:
    print(f"squaring {x}")
    return x * x


def fail(x: int) -> int:
    raise ValueError(f"no good: {x}")


def test_jobs_return_results_write_logs_and_name_failures(tmp_path):
    jobs = [Job(f"sq{i}", square, {"x": i}, tmp_path / f"r{i}" / "run.log") for i in range(3)]
    said = []
    assert run_jobs(jobs, 2, said.append) == {"sq0": 0, "sq1": 1, "sq2": 4}
    assert (tmp_path / "r2" / "run.log").read_text() == "squaring 2\n"
    assert said[0].startswith("started 3 run(s), 2 at a time") and len(said) == 4
    bad = [Job("bad", fail, {"x": 7}, tmp_path / "bad" / "run.log"), jobs[1]]
    with pytest.raises(RunsFailedError, match="bad: ValueError: no good: 7 \\(log: ") as e:
        run_jobs(bad, 2, said.append)
    assert list(e.value.failed) == ["bad"]
    assert "ValueError: no good: 7" in (tmp_path / "bad" / "run.log").read_text()  # traceback
    with pytest.raises(ValueError, match="parallel must be >= 1"):
        run_jobs(jobs, 0)


def test_compare_jobs_equal_the_runs_one_after_another(setup, tmp_path):  # noqa: F811
    config, _ = setup
    one = run_comparison(config, ["bf16", "nvfp4-nvidia"], tmp_path / "one", max_steps=3)
    two = run_comparison(config, ["bf16", "nvfp4-nvidia"], tmp_path / "two", max_steps=3,
                         jobs=2)
    assert [(r.recipe, r.val_loss, r.steps) for r in one] == [
        (r.recipe, r.val_loss, r.steps) for r in two]
    log = (tmp_path / "two" / "nvfp4-nvidia-s0" / "run.log").read_text()
    assert "nvfp4-nvidia" in log
    with pytest.raises(ValueError, match="jobs \\(--jobs\\) must be >= 1"):
        run_comparison(config, ["bf16"], tmp_path / "three", jobs=0)


def test_rl_compare_jobs_make_the_sft_start_first_and_equal_sequential_runs(tmp_path):
    cfg = tiny_config(tmp_path, steps=2, eval_every=0, sft_steps=20)
    one = run_rl_comparison(cfg, ["bf16", "nvfp4"], tmp_path / "one", log=lambda *a: None)
    said = []
    two = run_rl_comparison(cfg, ["bf16", "nvfp4"], tmp_path / "two", log=said.append, jobs=2)
    keys = ("run", "final_reward", "k3_mean", "final_pass_at_1")
    assert [[r[k] for k in keys] for r in one] == [[r[k] for k in keys] for r in two]
    assert any(s.startswith("SFT warm-up, seed 0: done") for s in said)
    sft_one = torch.load(tmp_path / "one" / "sft" / "sft_policy.pt", weights_only=False)
    sft_two = torch.load(tmp_path / "two" / "sft" / "sft_policy.pt", weights_only=False)
    assert all(torch.equal(sft_one["state_dict"][k], v)
               for k, v in sft_two["state_dict"].items())
    assert "policy: loaded the SFT warm-up" in (tmp_path / "two" / "nvfp4" / "run.log").read_text()
    assert json.loads((tmp_path / "two" / "rl_compare.json").read_text())
