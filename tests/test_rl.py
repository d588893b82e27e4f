"""Rollout engine, weight sync and the GRPO loop on CPU: exactness, self-check, learning."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fp4stack
from fp4stack.convert import quantize_model
from fp4stack.data.char_tokenizer import CharTokenizer
from fp4stack.data.tasks import load_task
from fp4stack.models import GPT, GPTConfig
from fp4stack.rl import policy as lm
from fp4stack.rl.compare import run_rl_comparison
from fp4stack.rl.config import RLConfig, load_rl_config
from fp4stack.rl.rollout import RolloutEngine, sample_next
from fp4stack.rl.start import SFT_FILE, prepare_policy
from fp4stack.rl.sync import WeightSyncError, checksum, export_weights, load_weights
from fp4stack.rl.trainer import run_rl
from fp4stack.train.metrics import read_metrics

TOK = CharTokenizer()


def policy(moe: bool = True, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig.tiny_moe if moe else GPTConfig.tiny
    return GPT(cfg(vocab_size=TOK.vocab_size, max_seq_len=32)).eval()


PROMPTS = [TOK.encode(p) for p in ("12+34=", "7+5=", "40+41=", "3+3=")]


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("precision,trainer_recipe", [("bf16", None), ("fp8", "w8a8"),
                                                      ("nvfp4", "w4a4")])
def test_engine_logprobs_equal_the_trainers_at_the_same_precision(moe, precision,
                                                                  trainer_recipe):
    base = policy(moe)
    engine = RolloutEngine(base, TOK, precision, max_new_tokens=5)
    if trainer_recipe is not None:  # the same GEMMs, on master weights the trainer can update
        quantize_model(base, fp4stack.recipe(trainer_recipe).with_(weight_storage="master"))
    engine.sync(base)
    out = engine.generate(PROMPTS, torch.Generator().manual_seed(0))
    lp = lm.token_logprobs(base, out.tokens, out.mask).masked_fill(~out.response_mask, 0)
    assert out.response_mask.any()
    assert torch.equal(lp, out.logprobs)  # bit for bit


def test_sampled_logprobs_match_the_score_pass_to_rounding():
    base = policy()
    eng = {m: RolloutEngine(base, TOK, "bf16", max_new_tokens=5, logprobs=m)
           for m in ("score", "sample")}
    outs = {m: e.generate(PROMPTS, torch.Generator().manual_seed(1)) for m, e in eng.items()}
    assert torch.equal(outs["score"].tokens, outs["sample"].tokens)
    torch.testing.assert_close(outs["sample"].logprobs, outs["score"].logprobs,
                               rtol=1e-5, atol=1e-5)


def test_quads_with_every_channel_compensated_is_the_qat_w_trainer():
    base = policy()
    engine = RolloutEngine(base, TOK, "quads", max_new_tokens=5, compensation=1.0)
    quantize_model(base, "qat-w")
    engine.sync(base)
    out = engine.generate(PROMPTS, torch.Generator().manual_seed(0))
    lp = lm.token_logprobs(base, out.tokens, out.mask).masked_fill(~out.response_mask, 0)
    torch.testing.assert_close(out.logprobs, lp, rtol=1e-4, atol=1e-4)
    naive = RolloutEngine(policy(), TOK, "nvfp4", max_new_tokens=5)
    naive.sync(base)
    lq = lm.token_logprobs(naive.model, out.tokens, out.mask).masked_fill(~out.response_mask, 0)
    assert (lq - lp).abs().max() > 10 * (out.logprobs - lp).abs().max()


def test_sync_ships_the_trainers_quantized_weights_and_catches_corruption():
    base = policy()
    engine = RolloutEngine(base, TOK, "nvfp4")
    quantize_model(base, "qat-w")
    with torch.no_grad():
        for p in base.parameters():
            p.add_(0.01 * torch.randn_like(p))  # the trainer moved
    assert engine.sync(base) > 0
    # The engine's packed weights are the trainer's fake-quantized ones, value for value.
    layer = base.model.layers[0].self_attn.q_proj
    packed = engine.model.model.layers[0].self_attn.q_proj
    assert torch.equal(fp4stack.dequantize(packed.packed_weight, torch.float32),
                       layer.quantized_weight(torch.float32))
    update = export_weights(base, engine.model, engine.amax_groups)
    name = "model.layers.1.mlp.experts.gate_up_data"
    update.tensors[name] = update.tensors[name].clone()
    update.tensors[name][2, 5, 3] ^= 0x10  # one flipped bit in one expert's packed weight
    with pytest.raises(WeightSyncError, match=r"mlp\.experts\.gate_up\[2\]"):
        load_weights(engine.model, update)
    update = export_weights(base, engine.model, engine.amax_groups)
    update.tensors["model.norm.weight"] = update.tensors["model.norm.weight"] * 1.001
    with pytest.raises(WeightSyncError, match="model.norm.weight"):
        load_weights(engine.model, update)


def test_a_stacks_checksums_are_each_entrys_from_one_dequantization():
    # Each entry decoded with its own amax (nine decades apart here), summed in one reduction:
    # the checksums of dequantizing one expert at a time.
    import fp4stack.rl.sync as sync
    from fp4stack.formats.spec import QuantSpec
    from fp4stack.nn.packed import PackedSlot

    spec = QuantSpec(nan_policy="propagate")
    w = torch.randn(4, 24, 40) * torch.logspace(-6, 3, 4)[:, None, None]
    packed = fp4stack.quantize_stack(w, spec)
    slot = PackedSlot("gate_up", "gate_up_proj", torch.Size((24, 40)), spec, "amax", count=4)
    state = slot.state(packed)
    sums = sync._stack_checksums(*(state[k] for k in slot.keys), slot)
    assert list(sums) == [f"gate_up[{i}]" for i in range(4)]
    for i, q in enumerate(packed):
        assert int(sums[f"gate_up[{i}]"]) == checksum(fp4stack.dequantize(q, torch.float32))
        assert torch.equal(fp4stack.dequantize(q), fp4stack.fake_quantize(w[i], spec=spec))
    amax = state["gate_up_amax"].clone()
    amax[1] *= 2  # a stale amax of one expert moves its checksum alone
    moved = sync._stack_checksums(state["gate_up_data"], state["gate_up_scales"], amax, slot)
    assert [int(moved[k]) != int(sums[k]) for k in sums] == [False, True, False, False]


def test_checksum_sees_position_and_value():
    t = torch.randn(64)
    assert checksum(t) == checksum(t.clone())
    assert checksum(t) != checksum(t.flip(0))
    u = t.clone()
    u[7] = torch.nextafter(u[7], torch.tensor(10.0))
    assert checksum(t) != checksum(u)


def test_checksum_is_its_formula_with_cached_and_fresh_weights(monkeypatch):
    import fp4stack.rl.sync as sync

    def formula(t):  # sum_i bits_i * (i * MIX mod 2^32 | 1), wrapping in int64
        bits = t.float().view(-1).view(torch.int32).tolist()
        total = sum(b * ((i * sync._MIX) % (1 << 32) | 1) for i, b in enumerate(bits))
        return (total + (1 << 63)) % (1 << 64) - (1 << 63)

    monkeypatch.setattr(sync, "_CACHED_WEIGHTS", 100)
    for n in (37, 100, 101, 300):  # cached up to 100 elements, made afresh above
        t = torch.randn(n)
        assert checksum(t) == checksum(t) == formula(t), n


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {int(sample_next(logits, 1.0, 0.75, torch.Generator().manual_seed(s))[0])
            for s in range(200)}
    assert seen == {0, 1}
    nxt, lp = sample_next(logits, 0.0, 1.0, None)
    assert int(nxt) == 0 and float(lp) == pytest.approx(float(torch.log(torch.tensor(0.5))))


def test_generation_stops_at_eos_and_pads_after():
    base = policy()
    engine = RolloutEngine(base, TOK, "bf16", max_new_tokens=8)
    engine.sync(base)
    out = engine.generate(PROMPTS * 8, torch.Generator().manual_seed(0))
    resp = out.tokens[:, out.prompt_len:]
    keep = out.response_mask[:, out.prompt_len:]
    stopped = 0
    for row, k in zip(resp.tolist(), keep.tolist(), strict=True):
        n = sum(k)
        assert k == [True] * n + [False] * (len(k) - n)  # a prefix of the response is real
        if TOK.eos_id in row[:n]:
            stopped += 1
            assert row.index(TOK.eos_id) == n - 1  # ... ending at the first EOS
            assert all(t == TOK.pad_id for t in row[n:])
        else:
            assert n == len(row)
    assert stopped > 0
    assert (out.logprobs[~out.response_mask] == 0).all()
    assert (out.logprobs[out.response_mask] < 0).all()


def test_routing_replay_reproduces_the_engines_experts():
    base = policy()
    engine = RolloutEngine(base, TOK, "bf16", max_new_tokens=4)
    engine.sync(base)
    out = engine.generate(PROMPTS, torch.Generator().manual_seed(0), record=True)
    assert out.routing and all(v.shape[:2] == out.tokens.shape for v in out.routing.values())
    with base.replay_routing(out.routing):
        lp = lm.token_logprobs(base, out.tokens, out.mask)
    assert torch.equal(lp.masked_fill(~out.response_mask, 0), out.logprobs)


def tiny_config(tmp_path, **overrides) -> RLConfig:
    base = dict(policy={"kind": "gpt", "preset": "tiny-moe", "moe_hidden": 64},
                task="arithmetic:add", task_options={"level": 1, "n_test": 25}, sft_steps=60,
                steps=3, prompts_per_step=8, group_size=4, max_new_tokens=3, eval_every=3,
                eval_size=25, out=str(tmp_path / "{rollout}"), device="cpu")
    return RLConfig(**{**base, **overrides})


def test_rl_writes_every_metric_each_step(tmp_path):
    result = run_rl(tiny_config(tmp_path, eval_pass_k=4), log=lambda *a: None)
    records = read_metrics(tmp_path / "quads")
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    keys = {"step", "reward", "k1", "k3", "logp_diff_mean", "logp_diff_max", "prob_diff_max",
            "chi2_token", "chi2_seq", "ess", "entropy", "response_len", "generate_s", "train_s",
            "sync_s", "step_s"}
    assert all(keys <= set(r) for r in steps)
    assert "pass_at_1" in steps[-1] and "pass_at_1" in records[0]
    assert 0 <= steps[-1]["pass_at_1"] <= 1 and 0 <= steps[-1]["pass_at_4"] <= 1
    assert result["steps"] == 3 and result["k3_mean"] >= 0


EASY_TASK = """
from fp4stack.data.tasks import ArithmeticTask


class SevenTask(ArithmeticTask):
    \"\"\"Any arithmetic prompt; the reward is for answering with a 7 first.\"\"\"

    def score(self, response, example):
        return float(response.startswith("7"))

    def completion(self, example):
        return "7"


def make_task(**options):
    return SevenTask(ops="add", level=1, n_test=25)
"""


def test_grpo_raises_reward_on_an_easy_task(tmp_path, monkeypatch):
    # An untrained policy, a user task plugged in by module path, a reward GRPO can find fast.
    (tmp_path / "seven_task.py").write_text(EASY_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tiny_config(tmp_path, task="seven_task:make_task", task_options={}, rollout="bf16",
                      trainer="bf16", steps=10, lr=3e-3, prompts_per_step=16, group_size=8,
                      eval_every=0, sft_steps=0)
    run_rl(cfg, log=lambda *a: None)
    rewards = [r["reward"] for r in read_metrics(tmp_path / "bf16")]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards


def test_rl_compare_table_from_one_start(tmp_path):
    cfg = tiny_config(tmp_path, steps=2, eval_every=0)
    said = []
    rows = run_rl_comparison(cfg, ["bf16", "quads"], tmp_path / "cmp", log=said.append)
    # A run is reported by its full name: a quads run with the share and mode it ran at.
    assert [r["run"] for r in rows] == ["bf16", "quads@0.5:static"] and rows[0]["k3_max"] == 0.0
    cached = tmp_path / "cmp" / "sft" / SFT_FILE
    assert [s for s in said if s.startswith("policy:")] == [
        f"policy: loaded the SFT warm-up from {cached}"]  # the second run reuses the first's
    table = (tmp_path / "cmp" / "rl_compare.md").read_text()
    assert "| quads@0.5:static | 0 | quads | qat-w |" in table
    assert (tmp_path / "cmp" / "quads" / "result.json").exists()  # its directory as typed
    with pytest.raises(ValueError, match="name the same run twice"):
        run_rl_comparison(cfg, ["quads", "quads@0.5:static"], tmp_path / "cmp")


def test_the_sft_warm_up_is_reused_only_for_the_inputs_that_made_it(tmp_path):
    def start(cfg, cache_dir):
        said = []
        model, _ = prepare_policy(cfg, load_task(cfg.task, **cfg.task_options),
                                  torch.device("cpu"), cache_dir, said.append)
        return model.state_dict(), [s for s in said if s.startswith("policy:")]

    cfg = tiny_config(tmp_path, sft_steps=2)
    first, _ = start(cfg, tmp_path)
    again, said = start(cfg, tmp_path)  # what rl-compare's runs do: one config, one warm-up
    assert said == [f"policy: loaded the SFT warm-up from {tmp_path / SFT_FILE}"]
    assert all(torch.equal(first[k], again[k]) for k in first)
    for other in (cfg.with_overrides(seed=1), cfg.with_overrides(task="arithmetic:mul"),
                  cfg.with_overrides(sft_recipe="qat-w")):
        fresh, _ = start(other, None)
        got, said = start(other, tmp_path)
        assert len(said) == 1 and "does not match this run's SFT inputs" in said[0], said
        assert all(torch.equal(fresh[k], got[k]) for k in fresh)


def test_the_sft_warm_up_runs_deterministic_algorithms_and_restores_the_mode(tmp_path,
                                                                            monkeypatch):
    import fp4stack.rl.start as start

    seen = []
    real = start.sft_warmup

    def recording(*args, **kwargs):
        seen.append((torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled()))
        return real(*args, **kwargs)

    monkeypatch.setattr(start, "sft_warmup", recording)
    cfg = tiny_config(tmp_path, sft_steps=1)
    before = torch.are_deterministic_algorithms_enabled()
    prepare_policy(cfg, load_task(cfg.task, **cfg.task_options), torch.device("cpu"), None,
                   lambda _: None)
    assert seen == [(True, True)]
    assert torch.are_deterministic_algorithms_enabled() == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sft_warm_ups_repeat_bitwise(tmp_path):
    cfg = tiny_config(tmp_path, sft_steps=20, device="cuda")
    task = load_task(cfg.task, **cfg.task_options)
    a, b = (prepare_policy(cfg, task, torch.device("cuda"), None, lambda _: None)[0].state_dict()
            for _ in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("bad,match", [({"rollout": "fp4"}, "rollout"),
                                       ({"group_size": 1}, "group_size"),
                                       ({"policy": {"kind": "x"}}, "policy.kind"),
                                       ({"top_p": 0}, "top_p")])
def test_config_errors_name_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        RLConfig(**bad)


def test_yaml_preset_loads_and_unknown_keys_fail(tmp_path):
    cfg = load_rl_config("configs/rl/tiny.yaml")
    assert cfg.rollout == "quads" and cfg.trainer == "qat-w"
    (tmp_path / "bad.yaml").write_text("rollot: quads\n")
    with pytest.raises(ValueError, match="did you mean 'rollout'"):
        load_rl_config(tmp_path / "bad.yaml")


def test_tasks_plug_in_by_module_path():
    task = load_task("fp4stack.data.tasks:ArithmeticTask", ops="mul", level=1, n_test=10)
    ex = task.test_set()[0]
    assert task.score(task.completion(ex), ex) == 1.0


def test_a_bf16_engine_keeps_computed_constants_in_fp32():
    base = policy()
    base.register_buffer("inv_freq", torch.rand(8, dtype=torch.float32), persistent=False)
    engine = RolloutEngine(base, TOK, "bf16", dtype=torch.bfloat16)
    assert engine.model.inv_freq.dtype == torch.float32
    assert torch.equal(engine.model.inv_freq, base.inv_freq)
    assert engine.model.lm_head.weight.dtype == torch.bfloat16


def test_time_limit_ends_with_a_whole_step_and_a_final_evaluation(tmp_path):
    # A limit the first step already overruns: the run still makes that one whole step, with
    # the pass@1 evaluation a last step gets, and stops.
    logs = []
    cfg = tiny_config(tmp_path, steps=10, eval_every=5, sft_steps=0, max_minutes=1e-9)
    result = run_rl(cfg, log=logs.append)
    records = [r for r in read_metrics(tmp_path / "quads") if r["step"] > 0]
    assert [r["step"] for r in records] == [1] and result["steps"] == 1
    assert "pass_at_1" in records[-1] and result["final_pass_at_1"] == records[-1]["pass_at_1"]
    assert any("time limit" in line for line in logs)


def test_time_limit_must_be_a_number():
    with pytest.raises(ValueError, match="max_minutes"):
        RLConfig(max_minutes="5m")


def test_kl_reference_after_a_fresh_sft_warm_up(tmp_path):
    # The KL reference is a copy of the policy made right after an in-process SFT warm-up,
    # whose last forward left graph-attached aux losses on the MoE blocks.
    cfg = tiny_config(tmp_path, kl_coef=0.1, sft_steps=3, steps=1, eval_every=0)
    result = run_rl(cfg, log=lambda *a: None)
    assert result["steps"] == 1


def test_rl_compare_run_names_parse_into_the_arms():
    from fp4stack.rl.compare import parse_run

    assert parse_run("bf16") == {"rollout": "bf16", "trainer": "bf16", "correction": "none"}
    assert parse_run("nvfp4+tis")["correction"] == "token-tis"
    assert parse_run("w4a16")["trainer"] == "qat-w"  # the paper's W4A16 ablation
    assert parse_run("quads@0.125") == {"rollout": "quads", "trainer": "qat-w",
                                        "correction": "none", "compensation": 0.125}
    assert parse_run("nvfp4-token/qat-w+tis") == {"rollout": "nvfp4-token", "trainer": "qat-w",
                                                  "correction": "token-tis"}
    assert parse_run("quads@0.5:static")["compensation_mode"] == "static"
    for bad, match in (("fp4", "rollout 'fp4'"), ("nvfp4@0.5", "quads"), ("quads@1.5", r"\(0, 1\]"),
                       ("nvfp4:static", "compensation mode"),
                       ("bf16/fp32", "trainer 'fp32'"), ("quads 0.5", "ROLLOUT")):
        with pytest.raises(ValueError, match=match):
            parse_run(bad)


def test_a_bfloat16_trainer_computes_under_autocast(tmp_path):
    # A float32 engine on the CPU and a float32 trainer agree bit for bit (k3 = 0); the
    # bfloat16 trainer's forward differs from the engine's by bf16 rounding.
    runs = {dtype: run_rl(tiny_config(tmp_path / dtype, rollout="bf16", trainer="bf16",
                                      trainer_dtype=dtype, steps=1, eval_every=0, sft_steps=3),
                          log=lambda *a: None)
            for dtype in ("float32", "bfloat16")}
    assert runs["float32"]["k3_mean"] == 0.0 and runs["bfloat16"]["k3_mean"] > 0.0
    assert runs["bfloat16"]["trainer_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="trainer_dtype must be one of"):
        tiny_config(tmp_path, trainer_dtype="fp16")


def test_static_compensation_is_calibrated_once_before_the_first_rollout(tmp_path):
    lines = []
    result = run_rl(tiny_config(tmp_path, compensation_mode="static", compensation=0.25,
                                calibration_size=8, steps=2, eval_every=0, sft_steps=3),
                    log=lines.append)
    assert result["compensation_mode"] == "static" and result["steps"] == 2
    assert sum("compensation channels fixed from 8 task examples" in ln for ln in lines) == 1
    assert any(ln == f"rl: start weights {result['start_weights']}" for ln in lines)
    with pytest.raises(ValueError, match="compensation_mode must be one of"):
        tiny_config(tmp_path, compensation_mode="fixed")


def test_rl_compare_seeds_and_compensation_fractions(tmp_path):
    cfg = tiny_config(tmp_path, steps=2, eval_every=2, sft_steps=2)
    out = tmp_path / "cmp"
    rows = run_rl_comparison(cfg, ["quads@0.25", "quads@1.0"], out, log=lambda *a: None,
                             seeds=[0, 1])
    assert [(r["run"], r["seed"]) for r in rows] == [
        ("quads@0.25:static", 0), ("quads@1:static", 0), ("quads@0.25:static", 1),
        ("quads@1:static", 1)]
    assert [r["compensation"] for r in rows] == [0.25, 1.0, 0.25, 1.0]
    assert (out / "sft" / SFT_FILE).exists() and (out / "sft-seed1" / SFT_FILE).exists()
    assert (out / "quads@1.0" / "seed1" / "result.json").exists()
    # Every channel compensated: Q(x)Q(W)ᵀ + (x - Q(x))Q(W)ᵀ, the trainer's x Q(W)ᵀ up to the
    # rounding of that sum; a quarter of them leaves most of the activation error.
    assert all(r["dlogp_max_max"] < 1e-5 for r in rows[1::2])
    assert all(r["dlogp_max_mean"] > 1e-3 for r in rows[::2])
    assert all(r["start_pass_at_1"] is not None for r in rows)
    table = (out / "rl_compare.md").read_text()
    assert "| quads@0.25:static | 1 | quads | qat-w |" in table and "mean max abs dlogp" in table


def test_split_upcycle_config_builds_a_policy_of_mlp_slices():
    from fp4stack.rl.policies import build_policy

    cfg = RLConfig(policy={"kind": "gpt", "preset": "tiny"},
                   upcycle={"n_experts": 4, "top_k": 2, "split": True})
    model, _ = build_policy(cfg.policy, cfg.upcycle, seed=0, max_len=32)
    assert model.config.moe and model.config.moe_hidden == model.config.ffn_hidden // 4
    for bad, match in (({"n_experts": 4}, "top_k"), ({"n_experts": 4, "top_k": 2, "split": "yes"},
                                                      "upcycle.split"),
                       ({"n_experts": 4, "top_k": 2, "noise": 1}, "upcycle takes"),
                       ({"n_experts": 4, "top_k": 2, "expert_noise": 1.5}, "expert_noise"),
                       ({"n_experts": 4, "top_k": 2, "expert_noise": True}, "expert_noise")):
        with pytest.raises(ValueError, match=match):
            RLConfig(upcycle=bad)


def test_copy_upcycle_config_with_expert_noise_makes_experts_differ():
    from fp4stack.rl.policies import build_policy

    cfg = RLConfig(policy={"kind": "gpt", "preset": "tiny"},
                   upcycle={"n_experts": 4, "top_k": 2, "expert_noise": 0.01})
    model, _ = build_policy(cfg.policy, cfg.upcycle, seed=0, max_len=32)
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    assert model.config.moe_hidden == model.config.ffn_hidden
    assert not torch.equal(experts[0], experts[1])
    assert torch.allclose(experts[0], experts[1], rtol=0.1, atol=0)  # copies, 1% apart


def test_activation_error_of_a_sample_batch_every_n_steps(tmp_path):
    cfg = tiny_config(tmp_path, steps=3, eval_every=0, sft_steps=2, activation_error_every=2,
                      compensation=0.25)
    run_rl(cfg, log=lambda *a: None)
    lines = [json.loads(x) for x in (tmp_path / "quads" / "activation_error.jsonl").open()]
    assert [x["step"] for x in lines] == [2, 3]  # every 2 steps and the last
    layers = lines[0]["layers"]
    names = {row["name"] for row in layers}
    assert any(n.endswith("q_proj") for n in names) and any("experts" in n for n in names)
    for row in layers:  # W4A4 error above either part's alone; compensation removes some gap
        assert row["both"] >= max(row["act_only"], row["weight_only"]) * 0.5 > 0
        assert 0 < row["compensated"][0]["gap_removed"] <= 1
    metrics = [r for r in read_metrics(tmp_path / "quads") if r.get("step") == 2][0]
    assert metrics["act_error"] == pytest.approx(  # the file keeps 6 significant digits
        sum(r["act_only"] for r in layers) / len(layers), rel=1e-5)
    assert all(r["both"] == float(f"{r['both']:.6g}") for r in layers)
    assert 0 < metrics["gap_removed"] < 1


def test_a_qat_w_update_quantizes_each_dense_weight_once_for_all_micro_batches(tmp_path,
                                                                              monkeypatch):
    from fp4stack.nn import operands
    from fp4stack.nn.linear import QuantLinear
    from fp4stack.rl.start import build_run, start_engine
    from fp4stack.rl.update import train_step

    cfg = tiny_config(tmp_path, sft_steps=2, micro_batch_size=3, prompts_per_step=4,
                      group_size=2, rollout="quads", trainer="qat-w")
    parts = build_run(cfg, torch.device("cpu"), tmp_path, log=lambda *a: None)
    start_engine(cfg, parts, log=lambda *a: None)
    examples = parts.task.train_examples(0)
    prompts = [TOK.encode(next(examples).prompt) for _ in range(8)]
    rollout = parts.engine.generate(prompts, torch.Generator().manual_seed(0))
    made, real = [], operands.quantize_operand
    monkeypatch.setattr(operands, "quantize_operand",
                        lambda w, *a, **k: made.append(id(w)) or real(w, *a, **k))
    train_step(parts.model, parts.opt, rollout, torch.randn(8), cfg, None)  # 3 micro-batches
    dense = {id(m.weight) for m in parts.model.modules() if isinstance(m, QuantLinear)}
    # One Q(W) per weight (it serves the forward and the dgrad), not one per micro-batch.
    assert dense and all(made.count(w) == 1 for w in dense)


def _one_step_parts(tmp_path, **overrides):
    from fp4stack.rl.start import build_run, start_engine

    cfg = tiny_config(tmp_path, sft_steps=2, prompts_per_step=4, group_size=2,
                      rollout="bf16", trainer="bf16", **overrides)
    parts = build_run(cfg, torch.device("cpu"), tmp_path, log=lambda *a: None)
    start_engine(cfg, parts, log=lambda *a: None)
    examples = parts.task.train_examples(0)
    prompts = [TOK.encode(next(examples).prompt) for _ in range(8)]
    return cfg, parts, parts.engine.generate(prompts, torch.Generator().manual_seed(0))


def _out_of_memory_above(monkeypatch, rows: int, spare: tuple[int, ...] = ()):
    """The trainer's forwards of more than `rows` rows run out of memory, except the n-th such
    forward for n in `spare` (1-based); the engine's scoring (no grad) never does."""
    real, seen = lm.token_logprobs, []

    def fake(model, tokens, *a, **k):
        if torch.is_grad_enabled() and tokens.shape[0] > rows:
            seen.append(tokens.shape[0])
            if len(seen) not in spare:
                raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real(model, tokens, *a, **k)

    monkeypatch.setattr(lm, "token_logprobs", fake)


def test_an_update_out_of_memory_is_redone_at_half_the_micro_batch(tmp_path, monkeypatch):
    from fp4stack.rl.update import train_step

    adv = torch.randn(8, generator=torch.Generator().manual_seed(3))
    cfg, parts, rollout = _one_step_parts(tmp_path / "a", micro_batch_size=2)
    train_step(parts.model, parts.opt, rollout, adv, cfg, None, log=lambda *a: None)
    want = [p.detach().clone() for p in parts.model.parameters()]
    # 8 rows do not fit; at 4 the first micro-batch fits and its backward runs, the second
    # does not; the step starts again at 2 and must give the plain run at 2.
    cfg, parts, rollout = _one_step_parts(tmp_path / "b", micro_batch_size=8)
    _out_of_memory_above(monkeypatch, rows=2, spare=(2,))
    said = []
    _, _, stats = train_step(parts.model, parts.opt, rollout, adv, cfg, None, log=said.append)
    assert stats["micro_batch_size"] == 2 and len(said) == 2 and "at 4" in said[0]
    assert all(torch.equal(a, b) for a, b in zip(want, parts.model.parameters(), strict=True))


def test_an_update_that_fits_no_micro_batch_raises(tmp_path, monkeypatch):
    from fp4stack.rl.update import train_step

    cfg, parts, rollout = _one_step_parts(tmp_path, micro_batch_size=2)
    _out_of_memory_above(monkeypatch, rows=0)
    with pytest.raises(torch.OutOfMemoryError):
        train_step(parts.model, parts.opt, rollout, torch.randn(8), cfg, None,
                   log=lambda *a: None)


def test_a_run_keeps_the_micro_batch_that_fit(tmp_path, monkeypatch):
    _out_of_memory_above(monkeypatch, rows=4)
    said = []
    run_rl(tiny_config(tmp_path, steps=2, micro_batch_size=32, eval_every=0), log=said.append)
    records = [r for r in read_metrics(tmp_path / "quads") if r["step"] > 0]
    assert [r["micro_batch_size"] for r in records] == [4, 4]
    assert sum("out of device memory" in s for s in said) == 3  # 32 -> 16 -> 8 -> 4, once


def test_a_compiled_trainer_updates_as_the_eager_one(tmp_path):
    # compile: the trainer's forward and backward through torch.compile (inductor on CPU here);
    # the first step samples from the same weights, so its rollouts and rewards are equal, and
    # its update equals the eager one up to the compiled kernels' rounding.
    from torch._dynamo.utils import counters

    runs = {}
    for mode in (False, True):
        said, graphs = [], counters["stats"]["unique_graphs"]
        run_rl(tiny_config(tmp_path / str(mode), steps=2, eval_every=0, compile=mode),
               log=said.append)
        runs[mode] = [r for r in read_metrics(tmp_path / str(mode) / "quads") if r["step"] > 0]
        assert any("through torch.compile" in s for s in said) == mode
        assert (counters["stats"]["unique_graphs"] > graphs) == mode  # compiled, or not at all
    (eager, compiled) = runs[False][0], runs[True][0]
    assert eager["reward"] == compiled["reward"]
    for key in ("loss", "grad_norm", "k3", "logp_diff_max"):
        assert compiled[key] == pytest.approx(eager[key], rel=1e-3, abs=1e-6), key
    assert len(runs[True]) == 2


def test_a_compiled_trainer_replays_the_engines_routing(tmp_path):
    # Routing is replayed on the policy's own MoE blocks, not on the compiled wrapper's
    # (whose module names carry an "_orig_mod." prefix the engine's routing does not).
    run_rl(tiny_config(tmp_path, steps=1, eval_every=0, compile=True, routing_replay=True),
           log=lambda *a: None)
    assert [r["step"] for r in read_metrics(tmp_path / "quads") if r["step"] > 0] == [1]


def test_cuda_graph_compile_modes_are_refused_in_rl_configs():
    with pytest.raises(ValueError, match="compile"):
        RLConfig(compile="reduce-overhead")
    with pytest.raises(ValueError, match="compile must be"):
        RLConfig(compile="fast")


def test_a_bf16_engine_keeps_its_routers_float32_and_refits_them():
    # Routers are never quantized and compute in float32: an engine in bfloat16 keeps their
    # gate weights as the trainer's float32 masters, in storage of its own.
    torch.manual_seed(0)
    policy = GPT(GPTConfig.tiny_moe(n_experts=4))
    engine = RolloutEngine(policy, TOK, "nvfp4", dtype=torch.bfloat16)

    def gates(model):
        return [p for n, p in model.named_parameters() if ".router." in n]

    assert gates(engine.model) and all(p.dtype == torch.float32 for p in gates(engine.model))
    assert next(engine.model.model.layers[0].self_attn.parameters()).dtype == torch.bfloat16
    for mine, master in zip(gates(engine.model), gates(policy), strict=True):
        assert torch.equal(mine, master) and mine.data_ptr() != master.data_ptr()
    with torch.no_grad():
        for p in gates(policy):
            p.add_(1e-3)  # below bfloat16's resolution at these magnitudes
    engine.sync(policy)
    assert all(torch.equal(a, b) for a, b in zip(gates(engine.model), gates(policy), strict=True))


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 400), st.lists(st.integers(0, 400), max_size=5), st.integers(0, 2**31))
def test_shard_checksums_add_up_to_the_whole_tensors(n, cuts, seed):
    # A tensor's contiguous shards, each checked with its offset, sum (wrapping in int64, as an
    # all-reduce of int64 sums does) to the whole tensor's checksum.
    t = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    bounds = sorted({0, n, *(c % (n + 1) for c in cuts)})
    total = sum(checksum(t[a:b], offset=a) for a, b in zip(bounds, bounds[1:], strict=False))
    assert (total + (1 << 63)) % (1 << 64) - (1 << 63) == checksum(t)
    if n > 1:  # an offset is a position: the same values elsewhere hash otherwise
        assert checksum(t[1:], offset=1) != checksum(t[1:])
