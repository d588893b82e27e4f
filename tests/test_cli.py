"""The `fp4stack` command: quant-error's numbers and structure, --help, --version, python -m."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from fp4stack import __version__
from fp4stack.analysis import DISTRIBUTIONS, METHODS
from fp4stack.cli import COMMANDS, main

ARGS = ["quant-error", "--rows", "64", "--cols", "128", "--format", "json"]
NVFP4 = [m.key for m in METHODS if m.key.startswith("nvfp4")]
FP8 = [m.key for m in METHODS if m.key.startswith("fp8")]


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def report() -> dict:
    # Module-scoped, so computed once; capsys is function-scoped, hence a manual capture.
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(ARGS) == 0
    return json.loads(buf.getvalue())


def errors(report: dict) -> dict[tuple[str, str], float]:
    return {(r["distribution"], r["method"]): r["rel_error"] for r in report["results"]}


def test_json_structure(report):
    assert report["rows"] == 64 and report["cols"] == 128 and report["seed"] == 0
    assert report["device"] == "cpu"
    assert report["nvfp4_backend"] == "reference"
    keys = {(r["distribution"], r["method"]) for r in report["results"]}
    assert keys == {(d.key, m.key) for d in DISTRIBUTIONS for m in METHODS}
    for r in report["results"]:
        assert set(r) == {"distribution", "method", "rel_error", "sqnr_db", "bits_per_value"}
        assert 0 < r["rel_error"] < 1
        assert r["sqnr_db"] == pytest.approx(-20 * math.log10(r["rel_error"]))
    bits = {r["method"]: r["bits_per_value"] for r in report["results"]}
    assert bits["nvfp4_rne"] == pytest.approx(4.5, abs=0.01)  # 4 + 8/16, plus the fp32 amax
    assert bits["fp8_tensor"] == pytest.approx(8.0, abs=0.01)
    assert bits["fp8_block128"] == pytest.approx(8.25)


def test_nvfp4_rne_gaussian_in_band(report):
    # NVFP4_SPEC: about 0.095 on randn with 1x16 RNE blocks.
    assert 0.085 < errors(report)[("gaussian", "nvfp4_rne")] < 0.105


@pytest.mark.parametrize("dist", [d.key for d in DISTRIBUTIONS])
def test_sr_error_above_rne(report, dist):
    e = errors(report)
    assert e[(dist, "nvfp4_sr")] > e[(dist, "nvfp4_rne")]


def test_four_over_six_not_worse_on_gaussian(report):
    e = errors(report)
    assert e[("gaussian", "nvfp4_4over6")] <= e[("gaussian", "nvfp4_rne")]


@pytest.mark.parametrize("dist", [d.key for d in DISTRIBUTIONS])
def test_fp8_below_every_nvfp4(report, dist):
    e = errors(report)
    assert max(e[(dist, m)] for m in FP8) < min(e[(dist, m)] for m in NVFP4)


def test_subprocess_matches_function(report):
    # Same numbers from a fresh interpreter: the tensors and the SR draw are seeded.
    proc = subprocess.run(
        [sys.executable, "-m", "fp4stack.cli", *ARGS],
        capture_output=True, text=True, timeout=300, check=True,
    )
    assert json.loads(proc.stdout) == report


def test_table_is_aligned(capsys):
    rc, out, _ = run_main(["quant-error", "--rows", "32", "--cols", "64"], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert "rel = ||x_hat - x|| / ||x||" in lines[0]
    rule = next(i for i, line in enumerate(lines) if line.startswith("---"))
    body = lines[rule + 1 : rule + 1 + len(METHODS)]
    assert [line.split("  ")[0].strip() for line in body] == [m.label for m in METHODS]
    assert len({len(line) for line in [lines[rule], *body]}) == 1  # every row as wide as the rule
    for d in DISTRIBUTIONS:
        assert d.label in out


def test_hadamard_not_applicable_when_k_not_multiple_of_16(capsys):
    argv = ["quant-error", "--rows", "8", "--cols", "24", "--format", "json"]
    rc, out, _ = run_main(argv, capsys)
    assert rc == 0
    for r in json.loads(out)["results"]:
        if r["method"] == "nvfp4_rht":
            assert r["rel_error"] is None
        else:
            assert 0 < r["rel_error"] < 1


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "quant-error" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["quant-error", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in ("--rows", "--cols", "--seed", "--format", "--device"):
        assert option in out


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"fp4stack {__version__}"


def test_no_command_prints_help(capsys):
    rc, _, err = run_main([], capsys)
    assert rc == 2 and "quant-error" in err


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        main(["quant-error", "--rows", "0"])
    assert e.value.code == 2
    capsys.readouterr()
    if not torch.cuda.is_available():
        rc, _, err = run_main(["quant-error", "--rows", "16", "--device", "cuda"], capsys)
        assert rc == 2 and "CUDA is not available" in err


def test_python_dash_m_fp4stack():
    proc = subprocess.run(
        [sys.executable, "-m", "fp4stack", "--version"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert proc.stdout.strip() == f"fp4stack {__version__}"


def test_ckpt_every_reaches_the_config(tmp_path, monkeypatch, capsys):
    from fp4stack.train import compare as compare_mod
    from fp4stack.train import trainer as trainer_mod

    seen = []

    def fake_train(cfg, **kwargs):
        seen.append(cfg)
        raise FileNotFoundError("stopped after the config")

    monkeypatch.setattr(trainer_mod, "train", fake_train)
    monkeypatch.setattr(compare_mod, "train", fake_train)
    config = tmp_path / "c.yaml"
    config.write_text("max_steps: 12\nckpt_every: 5\n")
    assert main(["pretrain", "--config", str(config), "--ckpt-every", "3"]) == 2
    assert main(["compare", "--config", str(config), "--recipes", "bf16", "--out",
                 str(tmp_path / "cmp"), "--ckpt-every", "4"]) == 2
    assert main(["pretrain", "--config", str(config)]) == 2
    assert [c.ckpt_every for c in seen] == [3, 4, 5]
    assert "stopped after the config" in capsys.readouterr().err
    assert main(["pretrain", "--config", str(config), "--ckpt-every", "-1"]) == 2
    assert "ckpt_every" in capsys.readouterr().err


@pytest.mark.parametrize("command", [None, *(c.name for c in COMMANDS)])
def test_help_has_no_literal_percent_escapes(command, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"] if command is None else [command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "%%" not in out and "%(" not in out


def test_rl_flags_offer_exactly_the_configs_choices():
    # The rl parser spells its choices out (no torch import to build it); they must stay the
    # config's, which the engines and trainers define.
    from fp4stack.rl import command, config, fast_rollout, rollout

    assert tuple(rollout.PRECISIONS) == command.ROLLOUTS
    assert command.TRAINERS == config.TRAINERS
    assert command.CORRECTIONS == config.CORRECTIONS
    assert command.ENGINES == fast_rollout.ENGINES


PROGRAM = """
import atexit, sys
import fp4stack.cli as cli
atexit.register(lambda: print("finalized", flush=True))
cli.main = lambda: int(sys.argv[1])
print("ran", flush=True)
cli.program()
"""


@pytest.mark.parametrize(("world", "status"), [("2", 0), ("2", 3), ("1", 0), ("1", 3)])
def test_program_leaves_a_finished_torchrun_rank_without_finalizing(world, status):
    """A rank that ended well leaves before the interpreter finalizes (where process-group
    threads kept alive by FSDP2 can abort it), its output flushed and status 0; a failed rank
    and a single process exit normally with main's status."""
    env = {**os.environ, "WORLD_SIZE": world}
    proc = subprocess.run([sys.executable, "-c", PROGRAM, str(status)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == status
    finalized = world == "1" or status != 0
    assert proc.stdout.split() == (["ran", "finalized"] if finalized else ["ran"])
