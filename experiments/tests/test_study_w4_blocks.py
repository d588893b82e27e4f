"""study_w4_blocks on the tiny policy: a row per variant, none kept removes nothing of the gap,
every block kept removes all of it (the float model's NLL, exactly), and a kept block changes
the copy's log-probs."""

import json
import sys

import pytest
import study_w4_blocks

from fp4stack.rl.config import load_rl_config


def test_variants_name_every_block_and_each_k():
    names = [v[0] for v in study_w4_blocks.variants(3, [1, 2])]
    assert names == ["all quantized", "block 0 kept", "block 1 kept", "block 2 kept",
                     "first 1 kept", "first 2 kept", "last 1 kept", "last 2 kept",
                     "first and last 1 kept", "first and last 2 kept"]


@pytest.fixture(scope="module")
def sft_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("sft")  # one warm-up for both recipes


@pytest.mark.parametrize("recipe", ["qat-w", "nvfp4"])
def test_shares_run_from_none_to_all(tmp_path, monkeypatch, recipe, sft_cache):
    assert load_rl_config("configs/rl/tiny.yaml").policy["preset"] == "tiny-moe"
    n_blocks = 2  # GPTConfig.tiny_moe's
    out = tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", [
        "study_w4_blocks.py", "--config", "configs/rl/tiny.yaml", "--recipes", recipe,
        "--prompts", "4", "--keeps", f"1,{n_blocks}", "--json", str(out),
        "--cache", str(sft_cache)])
    study_w4_blocks.main()
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert len(rows) == 1 + n_blocks + 3 * 2
    none, every = rows["all quantized"], rows[f"first {n_blocks} kept"]
    assert none["share_removed"] == 0.0 and none["dlogp_mean"] > 0.0
    assert every["nll"] == every["float_nll"] and every["dlogp_mean"] == 0.0
    assert every["share_removed"] == 1.0
    assert all(rows[f"block {i} kept"]["nll"] != none["nll"] for i in range(n_blocks))
