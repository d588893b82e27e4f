"""`make demo`'s configs are the tiny ones made smaller, and the demo's commands take --verbose."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from fp4stack.cli import build_parser
from fp4stack.rl.config import load_rl_config
from fp4stack.train.config import load_config

ROOT = Path(__file__).resolve().parent.parent
# The fields a demo config may change: how long it runs, how much it evaluates, where it writes.
PRETRAIN_SIZES = {"max_steps", "warmup_steps", "eval_every", "eval_batches", "ckpt_every", "out"}
RL_SIZES = {"steps", "eval_every", "eval_size", "out"}


def _yaml(path: str) -> dict:
    return yaml.safe_load((ROOT / path).read_text())


@pytest.mark.parametrize("kind, sizes, length", [("pretrain", PRETRAIN_SIZES, "max_steps"),
                                                 ("rl", RL_SIZES, "steps")])
def test_a_demo_config_is_tiny_with_only_its_sizes_changed(kind, sizes, length):
    tiny, demo = _yaml(f"configs/{kind}/tiny.yaml"), _yaml(f"configs/{kind}/demo.yaml")
    assert set(demo) == set(tiny)
    changed = {k for k in tiny if demo[k] != tiny[k]}
    assert changed <= sizes, f"demo.yaml changes {sorted(changed - sizes)}, not only sizes"
    assert demo[length] < tiny[length]
    assert demo["out"] != tiny["out"]  # a demo run never lands in (or resumes) a tiny run


def test_the_demo_configs_load():
    cfg = load_config(ROOT / "configs/pretrain/demo.yaml")
    assert cfg.max_steps <= 100 and cfg.data == "runs/data/tiny"
    assert cfg.warmup_steps < cfg.max_steps and cfg.eval_every <= cfg.max_steps
    rl = load_rl_config(ROOT / "configs/rl/demo.yaml")
    assert rl.steps <= 10 and rl.sft_steps == 300


def test_make_demo_runs_the_demo_configs():
    demo = re.search(r"^demo:.*?(?=^\S)", (ROOT / "Makefile").read_text(), re.M | re.S)[0]
    assert "--config configs/pretrain/demo.yaml" in demo
    assert "--config configs/rl/demo.yaml" in demo
    assert "tiny.yaml" not in demo


@pytest.mark.parametrize("argv", [["compare", "--config", "c.yaml"], ["rl-compare"],
                                  ["pretrain", "--config", "c.yaml"]])
def test_verbose_parses_and_is_off_by_default(argv):
    parser = build_parser()
    assert parser.parse_args(argv).verbose is False
    assert parser.parse_args([*argv, "--verbose"]).verbose is True
