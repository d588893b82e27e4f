"""Four Over Six block scales in RL (`four_over_six: true`): the rollout engine and the qat-w
trainer quantize the weights alike, so the engine's log-probs are the trainer's; the refit ships
Four Over Six weights; the fast engine decodes as the reference one; a run records the option."""

from __future__ import annotations

import json

import pytest
import torch

import fp4stack
from fp4stack.convert import quantize_model
from fp4stack.data.char_tokenizer import CharTokenizer
from fp4stack.models import GPT, GPTConfig
from fp4stack.nn.linear import QuantLinear
from fp4stack.nn.recipe import LINEAR_OPERANDS, PRESETS, four_over_six
from fp4stack.rl import policy as lm
from fp4stack.rl.compare import parse_sweep
from fp4stack.rl.config import RLConfig
from fp4stack.rl.fast_rollout import FastRolloutEngine
from fp4stack.rl.rollout import RolloutEngine
from fp4stack.rl.start import trainer_recipe
from fp4stack.rl.trainer import run_rl

TOK = CharTokenizer()
PROMPTS = [TOK.encode(p) for p in ("12+34=", "7+5=", "40+41=", "3+3=")]


def policy(moe: bool = True, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig.tiny_moe if moe else GPTConfig.tiny
    return GPT(cfg(vocab_size=TOK.vocab_size, max_seq_len=32)).eval()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_four_over_six_sets_every_nvfp4_operand_and_nothing_else(name):
    r = PRESETS[name]
    got = four_over_six(r)
    nvfp4 = [op for op in LINEAR_OPERANDS
             if getattr(r, op) is not None and getattr(r, op).format == "nvfp4"]
    for op in LINEAR_OPERANDS:
        before, after = getattr(r, op), getattr(got, op)
        if op in nvfp4:
            assert after.four_over_six
            assert after == before.__class__(**{**vars(before), "four_over_six": True})
        else:
            assert after == before  # FP8, unquantized and reusing operands as they were
    changed = any(not getattr(r, op).four_over_six for op in nvfp4)
    assert (got is r) == (not changed)
    assert got.name == (f"{r.name}+4over6" if changed else r.name)
    assert four_over_six(got) is got  # applying it twice changes nothing more
    fields = {f for f in vars(r) if f not in (*LINEAR_OPERANDS, "name")}
    assert all(getattr(got, f) == getattr(r, f) for f in fields)


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("precision,trainer", [("nvfp4", "w4a4"), ("w4a16", "qat-w"),
                                               ("quads", "qat-w")])
def test_the_engines_log_probs_are_the_four_over_six_trainers(moe, precision, trainer):
    base = policy(moe)
    comp = {"compensation": 1.0} if precision == "quads" else {}  # every channel: W4A16
    engine = RolloutEngine(base, TOK, precision, max_new_tokens=5, four_over_six=True, **comp)
    plain = RolloutEngine(base, TOK, precision, max_new_tokens=5, **comp)
    quantize_model(base, four_over_six(fp4stack.recipe(trainer)).with_(weight_storage="master"))
    engine.sync(base)
    plain.sync(base)
    out = engine.generate(PROMPTS, torch.Generator().manual_seed(0))
    lp = lm.token_logprobs(base, out.tokens, out.mask).masked_fill(~out.response_mask, 0)
    assert out.response_mask.any()
    if precision == "quads":  # x~ = Q(x) + (x - Q(x)) is x up to rounding
        torch.testing.assert_close(out.logprobs, lp, rtol=1e-4, atol=1e-4)
    else:
        assert torch.equal(out.logprobs, lp)  # bit for bit
    # The plain engine's weights are not the trainer's: its log-probs move.
    lq = lm.token_logprobs(plain.model, out.tokens, out.mask).masked_fill(~out.response_mask, 0)
    assert (lq - lp).abs().max() > 1e-3


def test_the_refit_ships_four_over_six_weights():
    base = policy(moe=False)
    engine = RolloutEngine(base, TOK, "w4a16", four_over_six=True)
    quantize_model(base, four_over_six(fp4stack.recipe("qat-w")))
    with torch.no_grad():
        for p in base.parameters():
            p.add_(0.01 * torch.randn_like(p))  # the trainer moved
    assert engine.sync(base) > 0
    layer = base.model.layers[0].mlp.down_proj
    packed = engine.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, QuantLinear) and layer.recipe.w.four_over_six
    got = fp4stack.dequantize(packed.packed_weight, torch.float32)
    assert torch.equal(got, layer.quantized_weight(torch.float32))
    plain = fp4stack.fake_quantize(layer.weight.detach().float())  # max mapped to 6 only
    assert not torch.equal(got, plain)


@pytest.mark.parametrize("precision", ["nvfp4", "quads", "w4a16"])
def test_the_fast_engine_decodes_four_over_six_as_the_reference(precision):
    base = policy()
    kw = dict(temperature=0.0, max_new_tokens=6, four_over_six=True)
    ref = RolloutEngine(base, TOK, precision, **kw)
    fast = FastRolloutEngine(base, TOK, precision, eos_check_every=2, **kw)
    a, b = ref.generate(PROMPTS), fast.generate(PROMPTS)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert fast.recipe.name.endswith("+4over6")


def test_config_checks_and_sweeps_the_option():
    with pytest.raises(ValueError, match="four_over_six must be true or false"):
        RLConfig(four_over_six="yes")
    cfg = RLConfig(trainer="qat-w", four_over_six=True)
    assert trainer_recipe(cfg).w.four_over_six and trainer_recipe(cfg).name == "qat-w+4over6"
    assert not trainer_recipe(RLConfig(trainer="qat-w")).w.four_over_six
    assert parse_sweep("four_over_six=false,true", RLConfig()) == ("four_over_six",
                                                                   [("false", False),
                                                                    ("true", True)])


def test_a_run_records_the_option_and_its_activation_errors(tmp_path):
    cfg = RLConfig(policy={"kind": "gpt", "preset": "tiny-moe", "moe_hidden": 64},
                   task="arithmetic:add", task_options={"level": 1, "n_test": 25}, sft_steps=2,
                   steps=2, prompts_per_step=4, group_size=2, max_new_tokens=3, eval_every=2,
                   eval_size=8, activation_error_every=1, rollout="w4a16", trainer="qat-w",
                   four_over_six=True, out=str(tmp_path / "run"), device="cpu")
    result = run_rl(cfg, log=lambda *a: None)
    assert result["four_over_six"] is True
    assert result["k3_max"] < 1e-6  # engine and trainer quantize the weights alike
    rows = [json.loads(line) for line in (tmp_path / "run" / "activation_error.jsonl").open()]
    assert rows and all(r["recipe"] == "w4a4+4over6" for r in rows)


def test_the_rl_command_takes_the_option(tmp_path, capsys):
    from fp4stack.cli import main

    config = tmp_path / "rl.yaml"
    config.write_text("policy: {kind: gpt, preset: tiny-moe, moe_hidden: 64}\n"
                      "task: arithmetic:add\ntask_options: {level: 1, n_test: 8}\n"
                      "sft_steps: 2\nsteps: 1\nprompts_per_step: 2\ngroup_size: 2\n"
                      "max_new_tokens: 3\neval_every: 1\neval_size: 4\ndevice: cpu\n")
    out = tmp_path / "run"
    assert main(["rl", "--config", str(config), "--rollout", "w4a16", "--trainer", "qat-w",
                 "--four-over-six", "--out", str(out)]) == 0
    assert json.loads((out / "result.json").read_text())["four_over_six"] is True
    assert "done: final reward" in capsys.readouterr().out
