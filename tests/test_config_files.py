"""Every config the project ships loads, and the recipes its `compare` command line names exist:
a typo in a preset a GPU session runs should fail here, on the CPU, not an hour into that run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fp4stack.models.gpt import GPT, GPTConfig
from fp4stack.nn.recipe import recipe
from fp4stack.rl.config import load_rl_config
from fp4stack.train.config import load_config

ROOT = Path(__file__).resolve().parent.parent
PRETRAIN = sorted((ROOT / "configs/pretrain").glob("*.yaml"))
RL = sorted((ROOT / "configs/rl").glob("*.yaml"))


def named_recipes(path: Path) -> list[str]:
    """The recipes of the `--recipes a,b,...` in a config's comments (a run's `+optimizer` cut)."""
    text = " ".join(line.lstrip("# ") for line in path.read_text().splitlines()
                    if line.startswith("#"))
    return [name.split("+")[0] for m in re.finditer(r"--recipes\s+\\?\s*([\w.,+-]+)", text)
            for name in m.group(1).split(",") if name]


@pytest.mark.parametrize("path", PRETRAIN, ids=lambda p: p.stem)
def test_pretrain_configs_load_and_name_real_recipes(path):
    cfg = load_config(path)
    assert cfg.global_batch_size % cfg.micro_batch_size == 0
    assert isinstance(cfg.model_config(vocab_size=8192), GPTConfig)
    for name in [cfg.recipe, *named_recipes(path)]:
        assert recipe(name).name == name


@pytest.mark.parametrize("path", RL, ids=lambda p: p.stem)
def test_rl_configs_load(path):
    cfg = load_rl_config(path)
    assert cfg.steps > 0 and cfg.group_size > 1


def test_the_docs_comparison_configs_differ_in_the_model_only():
    small, base = (load_config(ROOT / f"configs/pretrain/{n}-docs.yaml") for n in ("small", "base"))
    assert small.compile and base.compile
    tokens = [c.max_steps * c.global_batch_size * c.seq_len for c in (small, base)]
    assert tokens[0] == tokens[1] >= 200e6
    # Its commands train the BF16 baselines and the FP4 recipes apart, then report on them all.
    assert list(dict.fromkeys(named_recipes(ROOT / "configs/pretrain/small-docs.yaml"))) == [
        "bf16", "nvfp4-4over6", "nvfp4-4over6-attention", "lowrank-svd-4over6",
        "fullstack-paper", "fullstack-nvidia-noreuse"]
    sizes = [sum(p.numel() for p in GPT(c.model_config(8192)).parameters()) for c in (small, base)]
    assert 2 <= sizes[1] / sizes[0] <= 3  # "a 2-3x larger model"
