"""`rl-compare --report-from`: one report from the arms of a comparison trained apart."""

import json
import statistics

import pytest

from fp4stack.cli import main
from fp4stack.rl.compare import parse_run, run_rl_comparison
from fp4stack.rl.compare_report import collect_rows, run_name, seed_summary
from fp4stack.rl.config import RLConfig


def _tiny(**kw) -> RLConfig:
    base = dict(policy={"kind": "gpt", "preset": "tiny-moe", "moe_hidden": 64},
                task_options={"level": 1, "n_test": 4}, sft_steps=4, steps=2,
                prompts_per_step=2, group_size=2, max_new_tokens=3, eval_every=1, device="cpu")
    return RLConfig(**{**base, **kw})


def _quiet(*_):
    pass


@pytest.mark.parametrize("name", ["bf16", "fp8", "nvfp4", "nvfp4+tis", "w4a16", "nvfp4-token",
                                  "quads@0.5:dynamic", "quads@0.125:static",
                                  "quads-token@1:dynamic", "nvfp4/qat-w", "w4a16/bf16",
                                  "quads@0.25:dynamic/bf16+tis"])
def test_run_name_inverts_parse_run(name):
    result = {"compensation": 0.05, "compensation_mode": "static", **parse_run(name)}
    assert run_name(result) == name
    assert parse_run(run_name(result)) == parse_run(name)


def test_a_quads_name_says_the_mode_its_run_had():
    # A run asked for without a mode took the config's: its label names it either way, and a
    # result from before the field existed was dynamic.
    result = {"compensation": 0.5, **parse_run("quads@0.5")}
    assert run_name({**result, "compensation_mode": "static"}) == "quads@0.5:static"
    assert run_name({**result, "compensation_mode": "dynamic"}) == "quads@0.5:dynamic"
    assert run_name(result) == "quads@0.5:dynamic"


def test_arms_trained_apart_make_one_report(tmp_path, capsys):
    cfg = _tiny()
    first = run_rl_comparison(cfg, ["bf16"], tmp_path / "a", log=_quiet, verbose=False,
                              seeds=[0, 1])
    second = run_rl_comparison(cfg, ["quads@0.5"], tmp_path / "b", log=_quiet, verbose=False)
    out = tmp_path / "all"
    rc = main(["rl-compare", "--report-from", f"{tmp_path / 'a'},{tmp_path / 'b'}",
               "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    rows = json.loads((out / "rl_compare.json").read_text())
    assert [(r["run"], r["seed"]) for r in rows] == [("bf16", 0), ("bf16", 1),
                                                     ("quads@0.5:static", 0)]
    # Found where they are, with the numbers their own comparisons reported.
    assert [r["final_pass_at_1"] for r in rows] == [
        r["final_pass_at_1"] for r in first + second]
    assert rows[2]["out"] == str(tmp_path / "b" / "quads@0.5")
    summary = {s["run"]: s for s in seed_summary(rows)}
    assert summary["bf16"]["seeds"] == 2
    assert summary["bf16"]["pass_at_1"] == pytest.approx(
        statistics.fmean(r["final_pass_at_1"] for r in first))
    assert summary["bf16"]["pass_at_1_gain"] == pytest.approx(statistics.fmean(
        r["final_pass_at_1"] - r["start_pass_at_1"] for r in first))
    assert summary["quads@0.5:static"]["pass_at_1_sd"] is None  # one seed
    text = (out / "rl_compare.md").read_text()
    assert "Over the seeds:" in text and "| bf16 | 2 | 2 |" in text
    assert "Not one start" not in text and "| quads@0.5:static | 0 | quads | qat-w |" in printed
    pytest.importorskip("matplotlib")
    assert (out / "rl_compare.png").stat().st_size > 0


def test_runs_picks_the_arms_of_a_report_in_the_order_named(tmp_path, capsys):
    run_rl_comparison(_tiny(), ["bf16", "fp8", "quads@0.5"], tmp_path / "a", log=_quiet,
                      verbose=False)
    out = tmp_path / "two"
    assert main(["rl-compare", "--report-from", str(tmp_path / "a"), "--runs",
                 "quads@0.5:static,bf16", "--out", str(out)]) == 0
    rows = json.loads((out / "rl_compare.json").read_text())
    assert [r["run"] for r in rows] == ["quads@0.5:static", "bf16"]
    capsys.readouterr()
    # A name as typed for training, not as the report names it, is refused with the names found.
    assert main(["rl-compare", "--report-from", str(tmp_path / "a"), "--runs", "quads@0.5",
                 "--out", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "no finished run named quads@0.5;" in err and "bf16, fp8, quads@0.5:static" in err
    assert not (tmp_path / "none").exists()
    assert main(["rl-compare", "--report-from", str(tmp_path / "a"), "--runs", ",",
                 "--out", str(tmp_path / "none")]) == 2
    assert "--runs names no run" in capsys.readouterr().err


def test_runs_that_differ_in_a_field_are_named_by_it_and_other_starts_are_flagged(tmp_path,
                                                                                   capsys):
    run_rl_comparison(_tiny(), ["bf16"], tmp_path / "a", log=_quiet, verbose=False)
    run_rl_comparison(_tiny(sft_steps=6, lr=3e-4), ["bf16"], tmp_path / "b", log=_quiet,
                      verbose=False)
    rows = collect_rows([tmp_path / "a", tmp_path / "b"])
    assert [r["run"] for r in rows] == ["bf16 sft_steps=4 lr=0.0001", "bf16 sft_steps=6 lr=0.0003"]
    rc = main(["rl-compare", "--report-from", f"{tmp_path / 'a'},{tmp_path / 'b'}",
               "--out", str(tmp_path / "all")])
    assert rc == 1
    assert "Not one start: seed 0: the runs start from 2 different weights" in \
        capsys.readouterr().out


def test_an_older_runs_missing_field_reads_as_its_default_and_micro_batches_name_nothing(
        tmp_path):
    # Arms trained by an fp4stack without a later field (here sft_recipe), or at another
    # micro-batch size (the same update summed in another order), are one comparison.
    run_rl_comparison(_tiny(), ["bf16"], tmp_path / "a", log=_quiet, verbose=False)
    run_rl_comparison(_tiny(micro_batch_size=1), ["fp8"], tmp_path / "b", log=_quiet,
                      verbose=False)
    config = tmp_path / "a" / "bf16" / "config.json"
    older = json.loads(config.read_text())
    del older["sft_recipe"]
    config.write_text(json.dumps(older))
    assert [r["run"] for r in collect_rows([tmp_path / "a", tmp_path / "b"])] == ["bf16", "fp8"]
    # A field set away from its default in one of them still names the runs.
    run_rl_comparison(_tiny(sft_recipe="qat-w"), ["bf16"], tmp_path / "c", log=_quiet,
                      verbose=False)
    assert [r["run"] for r in collect_rows([tmp_path / "a", tmp_path / "c"])] == [
        "bf16 sft_recipe=bf16", "bf16 sft_recipe=qat-w"]


def test_report_errors_name_the_directory(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for dirs, match in ((tmp_path / "missing", "is not a directory"),
                        (tmp_path / "empty", "no finished run")):
        assert main(["rl-compare", "--report-from", str(dirs), "--out",
                     str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert match in err and str(dirs) in err


def test_rolling_mean_is_the_mean_of_the_window_ending_at_each_step():
    from fp4stack.rl.compare_report import rolling_mean

    values = [1.0, 3.0, 5.0, 7.0, 100.0]
    assert rolling_mean(values, 2) == [1.0, 2.0, 4.0, 6.0, 53.5]
    assert rolling_mean(values, 10) == [1.0, 2.0, 3.0, 4.0, 23.2]
    assert rolling_mean([], 3) == []


def test_a_finished_run_of_another_config_is_set_aside_and_trained_again(tmp_path):
    out, lines = tmp_path / "cmp", []
    first = run_rl_comparison(_tiny(compensation=0.25), ["quads", "bf16"], out,
                              log=lines.append, verbose=False)
    bf16_result = (out / "bf16" / "result.json").read_text()
    # The same config again: both runs are reused as they are.
    again = run_rl_comparison(_tiny(compensation=0.25), ["quads", "bf16"], out,
                              log=lines.append, verbose=False)
    assert [r["final_pass_at_1"] for r in again] == [r["final_pass_at_1"] for r in first]
    assert not any("trained again" in line for line in lines)
    # Another share: the finished quads run is moved aside, not reused, and trained anew.
    run_rl_comparison(_tiny(compensation=0.5), ["quads", "bf16"], out, log=lines.append,
                      verbose=False)
    # The bf16 run reads no compensation field: it is reused.
    moved = [line for line in lines if "trained again" in line]
    assert len(moved) == 1 and "quads" in moved[0]
    assert "compensation (0.25 -> 0.5)" in moved[0]
    assert json.loads((out / "quads" / "config.json").read_text())["compensation"] == 0.5
    assert (out / "bf16" / "result.json").read_text() == bf16_result
    stale = sorted((out / ".stale").iterdir())
    assert [p.name.rsplit("-", 2)[0] for p in stale] == ["quads"]
    old = json.loads((stale[0] / "result.json").read_text())  # nothing lost
    assert old["final_pass_at_1"] == first[0]["final_pass_at_1"]
    # A field every run reads sets both aside.
    lines.clear()
    run_rl_comparison(_tiny(compensation=0.5, lr=2e-4), ["quads", "bf16"], out,
                      log=lines.append, verbose=False)
    assert sum("trained again" in line for line in lines) == 2
    # A report of the comparison holds the current runs only.
    rows = collect_rows([out])
    assert sorted(r["run"] for r in rows) == ["bf16", "quads@0.5:static"]


def test_a_config_without_a_field_is_read_at_the_default_of_its_time(tmp_path):
    from fp4stack.rl.compare_report import saved_config

    (tmp_path / "config.json").write_text(json.dumps({"rollout": "quads", "lr": 1e-5}))
    saved = saved_config(tmp_path)
    assert (saved["compensation"], saved["compensation_mode"]) == (0.05, "dynamic")
    assert saved["lr"] == 1e-5 and saved["steps"] == RLConfig().steps
    assert saved_config(tmp_path / "missing") == {}
