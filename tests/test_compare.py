"""`fp4stack compare`: the same config, seed and tokens for each recipe; table, JSON and plot.
`fp4stack rl-compare`: a line per run, or every run's log with --verbose."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from fp4stack.data import write_shard
from fp4stack.rl.compare import RunProgress, parse_sweep, run_rl_comparison
from fp4stack.rl.config import RLConfig
from fp4stack.train.compare import (
    RunRow,
    format_table,
    gap_standard_error,
    gaps,
    run_comparison,
    seed_band,
)
from fp4stack.train.metrics import read_metrics

VOCAB = 48


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("compare")
    data = root / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    # A repeating pattern with noise: learnable in a few steps.
    base = np.tile(np.arange(VOCAB), 400)
    noisy = np.where(rng.random(base.size) < 0.1, rng.integers(0, VOCAB, base.size), base)
    write_shard(data / "train.bin", noisy[:16_000], VOCAB)
    write_shard(data / "val.bin", noisy[16_000:], VOCAB)
    (data / "manifest.json").write_text(json.dumps({"vocab_size": VOCAB}))
    cfg = dict(model={"preset": "tiny", "dim": 32, "n_layers": 3, "n_heads": 2, "n_kv_heads": 1,
                      "ffn_hidden": 64},
               data=str(data), seq_len=32, global_batch_size=8, micro_batch_size=8, lr=1e-2,
               min_lr=1e-3, warmup_steps=2, max_steps=6, eval_every=3, eval_batches=2,
               log_every=1, tensorboard=False, device="cpu")
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, root / "out"


def test_comparison_runs_every_recipe_on_the_same_tokens(setup):
    config, out = setup
    rows = run_comparison(config, ["bf16", "nvfp4"], out, baseline_seeds=(1,))
    assert [(r.recipe, r.seed) for r in rows] == [("bf16", 0), ("nvfp4", 0), ("bf16", 1)]
    assert all(np.isfinite(r.val_loss) and r.tokens_per_s > 0 for r in rows)
    # Same seed: the BF16 and NVFP4 runs saw the same tokens at every logged step.
    tok = {r.recipe + str(r.seed): [m["tokens"] for m in read_metrics(r.out)] for r in rows}
    base = (rows[0].val_loss + rows[2].val_loss) / 2
    assert tok["bf160"] == tok["nvfp40"]
    table = (out / "compare.md").read_text()
    assert "| nvfp4 | 0 |" in table and "noise floor" in table
    # The NVFP4 run's final weights evaluated with every quantizer off, and their gap.
    hp = json.loads((Path(rows[1].out) / "result.json").read_text())[
        "final_val_loss_high_precision"]
    assert rows[1].val_loss_high_precision == hp and rows[0].val_loss_high_precision is None
    assert f"| {hp:.4f} ({100 * (hp / base - 1):+.2f}%) |" in table
    assert (out / "compare.png").stat().st_size > 0
    assert len(json.loads((out / "compare.json").read_text())) == 3
    g = gaps(rows)
    assert g[("nvfp4", 0)] == pytest.approx(100 * (rows[1].val_loss - base) / base)


def test_finished_runs_are_reused(setup):
    config, out = setup
    first = run_comparison(config, ["bf16"], out)
    mtime = (Path(first[0].out) / "result.json").stat().st_mtime
    again = run_comparison(config, ["bf16"], out)
    assert (Path(again[0].out) / "result.json").stat().st_mtime == mtime
    assert again[0].val_loss == first[0].val_loss


def test_a_run_of_another_config_is_set_aside_and_trained_again(setup, tmp_path, capsys):
    config, _ = setup
    first = run_comparison(config, ["bf16"], tmp_path, log_every=2)
    result = (Path(first[0].out) / "result.json").read_text()
    # Logging and checkpoints change nothing the run computes: reused.
    run_comparison(config, ["bf16"], tmp_path, log_every=3, ckpt_every=2)
    assert "trained again" not in capsys.readouterr().out
    assert (Path(first[0].out) / "result.json").read_text() == result
    # Another lr: the run is moved under .stale (nothing lost) and trained anew with it.
    again = run_comparison(config, ["bf16"], tmp_path, lr=3e-3)
    printed = capsys.readouterr().out
    assert "trained again" in printed and "lr (0.01 -> 0.003)" in printed
    assert json.loads((Path(again[0].out) / "config.json").read_text())["lr"] == 3e-3
    assert again[0].val_loss != first[0].val_loss
    (aside,) = (tmp_path / ".stale").iterdir()
    assert aside.name.startswith("bf16-s0-") and (aside / "result.json").read_text() == result


def test_table_without_baseline_says_na(setup):
    table = format_table([RunRow("nvfp4", 0, 3.0, 100.0, 6, "x")])
    assert "n/a" in table


def test_every_recipe_runs_at_every_seed_and_is_summarised(setup, tmp_path):
    config, out = setup
    rows = run_comparison(config, ["bf16", "nvfp4"], tmp_path, seeds=(0, 1))
    assert sorted((r.recipe, r.seed) for r in rows) == [("bf16", 0), ("bf16", 1),
                                                         ("nvfp4", 0), ("nvfp4", 1)]
    table = format_table(rows)
    g = gaps(rows)
    mean_gap = (g[("nvfp4", 0)] + g[("nvfp4", 1)]) / 2
    mean_loss = (rows[2].val_loss + rows[3].val_loss) / 2
    assert f"| nvfp4 | 2 | {mean_loss:.4f} | {mean_gap:+.2f}% |" in table
    with pytest.raises(ValueError, match="seeds"):
        run_comparison(config, ["bf16"], tmp_path, seeds=())


def test_gap_standard_error_counts_both_means():
    rows = [RunRow("bf16", s, v, 1.0, 1, "x") for s, v in enumerate((3.0, 3.2, 3.1))]
    fp4 = [RunRow("nvfp4", s, v, 1.0, 1, "x") for s, v in enumerate((3.3, 3.5))]
    # variances 0.01 (BF16, 3 runs) and 0.02 (2 runs): sqrt(0.01/3 + 0.02/2) / 3.1
    expected = 100 * np.sqrt(0.01 / 3 + 0.02 / 2) / 3.1
    assert gap_standard_error(fp4, rows) == pytest.approx(expected)
    assert gap_standard_error(fp4[:1], rows) is None and gap_standard_error(fp4, rows[:1]) is None
    table = format_table(rows + fp4)
    assert f"| nvfp4 | 2 | 3.4000 | +9.68% | {expected:.2f}% | +6.45..+12.90% |" in table
    assert "| bf16 | 3 | 3.1000 | +0.00% | - |" in table


def test_no_train_reports_only_the_finished_runs(setup, tmp_path):
    config, _ = setup
    run_comparison(config, ["bf16"], tmp_path)
    rows = run_comparison(config, ["bf16", "nvfp4"], tmp_path, seeds=(0, 1), train_missing=False)
    assert [(r.recipe, r.seed) for r in rows] == [("bf16", 0)]
    assert not (tmp_path / "nvfp4-s0").exists()
    with pytest.raises(FileNotFoundError, match="no finished runs"):
        run_comparison(config, ["nvfp4"], tmp_path, train_missing=False)


def test_an_interrupted_run_resumes_from_its_checkpoint(setup, tmp_path):
    import shutil

    config, _ = setup
    whole = run_comparison(config, ["bf16"], tmp_path / "whole", ckpt_every=3)
    out = tmp_path / "cut"
    run_comparison(config, ["bf16"], out, ckpt_every=3)
    # As if killed after the step-3 checkpoint: no result, no later checkpoint.
    run = out / "bf16-s0"
    (run / "result.json").unlink()
    assert (run / "checkpoints" / "step_00000003").is_dir()
    for ckpt in (run / "checkpoints").iterdir():
        if ckpt.name != "step_00000003":
            shutil.rmtree(ckpt)
    again = run_comparison(config, ["bf16"], out, ckpt_every=3)
    assert (run / "result.json").exists()
    assert again[0].val_loss == whole[0].val_loss


def test_seed_band_spans_the_seeds_at_their_common_steps():
    curves = [{10: (100.0, 3.0), 20: (200.0, 2.0), 30: (300.0, 1.5)},
              {10: (100.0, 4.0), 20: (200.0, 1.0)},
              {10: (100.0, 2.0), 20: (200.0, 3.0), 40: (400.0, 1.0)}]
    band = seed_band(curves)
    assert list(band) == [10, 20]                    # steps 30 and 40 miss a seed
    assert band[10] == (100.0, 3.0, 2.0, 4.0)        # tokens, mean, min, max
    assert band[20] == (200.0, 2.0, 1.0, 3.0)
    assert seed_band([]) == {}
    assert seed_band(curves[:1]) == {t: (x, y, y, y) for t, (x, y) in curves[0].items()}


def test_a_recipe_file_runs_under_its_mapping_name(setup, tmp_path):
    config, _ = setup
    path = tmp_path / "x46.yaml"
    path.write_text("recipe:\n  preset: nvfp4\n  name: nvfp4-x46\n  x: {four_over_six: true}\n")
    out = tmp_path / "out"
    rows = run_comparison(config, ["bf16", str(path)], out, max_steps=2)
    assert [r.recipe for r in rows] == ["bf16", "nvfp4-x46"]
    run = out / "nvfp4-x46-s0"
    saved = json.loads((run / "config.json").read_text())
    assert saved["recipe"] == {"preset": "nvfp4", "name": "nvfp4-x46",
                               "x": {"four_over_six": True}}
    assert "| nvfp4-x46 | 0 |" in (out / "compare.md").read_text()
    # Reported again without training, the file still names its run.
    again = run_comparison(config, ["bf16", str(path)], out, train_missing=False)
    assert [(r.recipe, r.val_loss) for r in again] == [(r.recipe, r.val_loss) for r in rows]


@pytest.mark.parametrize("text, match", [
    (None, "recipe file .* not found"),
    ("recipe: {preset: nvfp4, x: {}}\n", r"x46\.yaml: recipe\.name: required"),
])
def test_a_bad_recipe_file_is_named(setup, tmp_path, text, match):
    config, _ = setup
    path = tmp_path / "x46.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        run_comparison(config, [str(path)], tmp_path / "out")


def test_rl_compare_shows_one_line_per_run_unless_verbose(tmp_path, capsys):
    cfg = RLConfig(policy={"kind": "gpt", "preset": "tiny-moe", "moe_hidden": 64},
                   task_options={"level": 1, "n_test": 4}, sft_steps=4, steps=2,
                   prompts_per_step=2, group_size=2, max_new_tokens=3, eval_every=0,
                   alarm_k3=0.0, device="cpu")
    lines = []
    rows = run_rl_comparison(cfg, ["bf16", "fp8"], tmp_path / "quiet", log=lines.append,
                             verbose=False)
    # BF16's k3 is exactly 0, never above the threshold 0; FP8's is above it at every step.
    assert [r["k3_max"] > 0 for r in rows] == [False, True]
    assert len(lines) == 2 and re.fullmatch(r"bf16: 2 steps in [\d.]+ s", lines[0])
    assert re.fullmatch(r"fp8: 2 steps in [\d.]+ s; mismatch alarm \(k3 > 0\) at 2 of them",
                        lines[1])
    assert "step 1/2" not in capsys.readouterr().out
    verbose = []
    run_rl_comparison(cfg, ["fp8"], tmp_path / "verbose", log=verbose.append)
    assert any(line.startswith("sft step 4/4 |") for line in verbose)
    assert any(line.startswith("step 2/2 |") for line in verbose)
    assert sum(line.startswith("alarm: ") for line in verbose) == 2
    # A line the bar does not stand for is printed.
    with RunProgress("x", 2) as progress:
        progress.log("time limit of 1 min: stopping after step 1")
    assert "time limit of 1 min" in capsys.readouterr().out


def _tiny_rl(**kw) -> RLConfig:
    return RLConfig(policy={"kind": "gpt", "preset": "tiny-moe", "moe_hidden": 64},
                    task_options={"level": 1, "n_test": 4}, sft_steps=4, steps=2,
                    prompts_per_step=2, group_size=2, max_new_tokens=3, eval_every=0,
                    device="cpu", **kw)


def test_a_sweep_parses_into_typed_values_of_one_field():
    cfg = _tiny_rl()
    assert parse_sweep("lr=1e-6, 3e-6", cfg) == ("lr", [("1e-6", 1e-6), ("3e-6", 3e-6)])
    assert parse_sweep("group_size=4,8", cfg) == ("group_size", [("4", 4), ("8", 8)])
    assert parse_sweep("routing_replay=true,false", cfg)[1] == [("true", True), ("false", False)]
    for bad, match in (("lr", "FIELD=V1"), ("=1", "FIELD=V1"), ("lr=", "FIELD=V1"),
                       ("learning_rate=1", "not an RL config field"),
                       ("lr=fast", "not of type float"),
                       ("group_size=2.5", "not of type int"),
                       ("group_size=1", "group_size"), ("lr=1e-6,1e-6", "twice"),
                       ("sft_lr=1e-3", "SFT start"), ("seed=1,2", "--seeds"),
                       ("rollout=fp8", "run names"), ("task_options=x", "SFT start")):
        with pytest.raises(ValueError, match=match):
            parse_sweep(bad, cfg)


def test_a_swept_comparison_runs_each_value_from_one_sft_start(tmp_path):
    rows = run_rl_comparison(_tiny_rl(lr=1e-4), ["bf16"], tmp_path, log=lambda *a: None,
                             verbose=False, sweep="lr=1e-4,3e-2")
    assert [r["run"] for r in rows] == ["bf16 lr=1e-4", "bf16 lr=3e-2"]
    lrs = [json.loads((tmp_path / d / "config.json").read_text())["lr"]
           for d in ("bf16-lr1e-4", "bf16-lr3e-2")]
    assert lrs == [1e-4, 3e-2]
    assert rows[0]["start_weights"] == rows[1]["start_weights"]  # the one SFT start
    assert (tmp_path / "sft" / "sft_policy.pt").exists()
    assert "bf16 lr=3e-2" in (tmp_path / "rl_compare.md").read_text()
