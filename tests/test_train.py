"""Pretraining loop: recipes train, logs, exact resume, NaN handling, config checks, checkpoints.

Every run here is a 3-block, 32-wide GPT on a synthetic Markov-chain token stream (learnable, so
the loss falls within a few steps), a fraction of a second per step on 2 CPU cores.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import types
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from fp4stack.cli import main
from fp4stack.data import write_shard
from fp4stack.models.gpt import GPT
from fp4stack.nn.attention_ablation import AttentionAblation
from fp4stack.nn.attention_quant import NVFP4_SR, NVFP4_TILES
from fp4stack.nn.recipe import LowRank
from fp4stack.nn.recipe import recipe as get_recipe
from fp4stack.optim import ROOT, AdamW4, Muon4
from fp4stack.train import NonFiniteLossError, from_dict, load_config, read_metrics, train
from fp4stack.train import checkpoint as ckpt_mod
from fp4stack.train import trainer as trainer_mod
from fp4stack.train.checkpoint import checkpoint_dirs, latest_checkpoint
from fp4stack.train.determinism import CUBLAS_WORKSPACE, deterministic_algorithms
from fp4stack.train.optimizers import (
    OptimizerChoice,
    build_from_config,
    build_optimizer,
    optimizer_of,
    param_groups,
    resolve_optimizer,
)
from fp4stack.train.run import start_run
from fp4stack.train.schedule import lr_at

VOCAB = 64
REPO = Path(__file__).resolve().parents[1]


def make_data(path: Path, vocab: int = VOCAB, n_train: int = 40_000, n_val: int = 4_000) -> Path:
    """A data directory of a random sparse first-order Markov chain (predictable: loss falls)."""
    rng = np.random.default_rng(0)
    cdf = rng.dirichlet(np.full(vocab, 0.1), size=vocab).cumsum(axis=1)

    def stream(n: int) -> np.ndarray:
        out, t = np.empty(n, dtype=np.int64), 0
        for i, u in enumerate(rng.random(n)):
            t = min(int(np.searchsorted(cdf[t], u)), vocab - 1)
            out[i] = t
        return out

    path.mkdir(parents=True)
    write_shard(path / "train.bin", stream(n_train), vocab)
    write_shard(path / "val.bin", stream(n_val), vocab)
    (path / "manifest.json").write_text(json.dumps({"vocab_size": vocab}))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_data(tmp_path_factory.mktemp("train") / "data")


def config(data: Path, out: Path, **overrides):
    d = dict(model={"preset": "tiny", "dim": 32, "n_layers": 3, "n_heads": 2, "n_kv_heads": 1,
                    "ffn_hidden": 64},
             data=str(data), seq_len=32, global_batch_size=8, micro_batch_size=4, lr=1e-2,
             min_lr=1e-3, warmup_steps=2, max_steps=8, eval_every=4, eval_batches=2, log_every=1,
             recipe="bf16", out=str(out), tensorboard=False, device="cpu")
    return from_dict({**d, **overrides})


MOE = {"preset": "tiny-moe", "dim": 32, "n_layers": 3, "n_heads": 2, "n_kv_heads": 1,
       "n_experts": 4, "top_k": 2, "moe_hidden": 32}


# `lowrank` with factors refreshed every 3 forwards, so short runs refresh; written as a config
# mapping, so a resume also checks that the mapping survives the checkpoint's config.json.
FAST_LOWRANK = {"preset": "lowrank", "name": "lowrank-refresh3",
                "lowrank": {"rank": 4, "refresh_every": 3}}


# ---------------------------------------------------------------------------------- recipes


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("recipe", ["bf16", "nvfp4", "nvfp4-nvidia", "lowrank", "qat-w",
                                    "nvfp4-nvidia@backward"])
def test_recipe_trains(data, tmp_path, recipe, moe):
    cfg = config(data, tmp_path, recipe=recipe, **({"model": MOE} if moe else {}))
    result = train(cfg)
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    assert np.mean(losses[-3:]) < losses[0] - 0.05, losses  # ln(64) = 4.16 at init
    assert math.isfinite(result["final_val_loss"]) and result["final_val_loss"] < losses[0]
    assert result["steps"] == 8 and result["tokens"] == 8 * 8 * 32 and result["nan_skips"] == 0
    assert result["tokens_per_s"] > 0 and result["wall_s"] > 0
    assert json.loads((tmp_path / "result.json").read_text())["recipe"] == recipe


def test_metrics_schema(data, tmp_path):
    cfg = config(data, tmp_path, log_every=3, max_steps=7, ckpt_every=3)
    train(cfg)
    records = read_metrics(tmp_path)
    # Every log_every steps, every eval step (4) and the last step (7, also an eval).
    assert [r["step"] for r in records] == [3, 4, 6, 7]
    for r in records:
        assert {"step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(r)
        assert r["tokens"] == r["step"] * 8 * 32
        assert r["lr"] == lr_at(r["step"] - 1, 1e-2, 1e-3, 2, 7)
        assert r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and "skipped" not in r
    assert [("val_loss" in r) for r in records] == [False, True, False, True]
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_00000006", "step_00000007"]
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["recipe"] == "bf16" and saved["betas"] == [0.9, 0.95]


def test_the_loop_pieces_make_the_records_train_logs(data, tmp_path):
    # train() is a loop over these pieces: driven by hand they give the same records and
    # validation loss, bit for bit, and leave the counters the result reports.
    train(config(data, tmp_path / "train", recipe="nvfp4-nvidia", max_steps=2, eval_every=2))
    run = start_run(config(data, tmp_path / "pieces", recipe="nvfp4-nvidia", max_steps=2,
                           eval_every=2), False, trainer_mod.distributed.setup("cpu"))
    run.bar = types.SimpleNamespace(disable=True)
    try:
        records = [trainer_mod.train_step(run, step) for step in range(2)]
        records[-1].update(trainer_mod.evaluate_step(run, 2, final=True))
        for record in records:
            trainer_mod.log_step(run, record)
        trainer_mod.save_run(run, 2)
    finally:
        run.logger.close()
    drop = lambda r: {k: v for k, v in r.items() if k != "tokens_per_s"}  # noqa: E731
    assert [drop(r) for r in read_metrics(tmp_path / "pieces")] == [
        drop(r) for r in read_metrics(tmp_path / "train")]
    assert "val_loss_high_precision" in records[-1] and run.interval_tokens == 0
    assert run.loss == records[-1]["loss"] and run.nan_skips == 0 and run.train_s > 0
    saved = json.loads((latest_checkpoint(tmp_path / "pieces") / "state.json").read_text())
    assert saved["step"] == 2 and saved["nan_skips"] == 0 and "lowrank_counters" not in saved


def test_tensorboard_scalars(data, tmp_path, monkeypatch, capsys):
    # A stand-in SummaryWriter: the real one needs the (optional, large) tensorboard package.
    scalars = []

    class Writer:
        def __init__(self, log_dir, purge_step=None):
            assert log_dir == str(tmp_path / "tensorboard")

        def add_scalar(self, tag, value, step):
            scalars.append((tag, step))

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard",
                        types.SimpleNamespace(SummaryWriter=Writer))
    train(config(data, tmp_path, max_steps=4, tensorboard=True))
    assert ("train/loss", 1) in scalars and ("val/loss", 4) in scalars
    assert ("train/tokens_per_s", 4) in scalars
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    from fp4stack.train import metrics

    metrics._note_no_tensorboard.cache_clear()  # the note is printed once per process
    capsys.readouterr()
    train(config(data, tmp_path / "b", max_steps=2, warmup_steps=1, tensorboard=True))
    train(config(data, tmp_path / "c", max_steps=2, warmup_steps=1, tensorboard=True))
    assert capsys.readouterr().err.count("tensorboard is not installed") == 1


def test_lr_schedule():
    lrs = [lr_at(s, 1.0, 0.1, 4, 20) for s in range(25)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False))
    assert lrs[20:] == [0.1] * 5 and lrs[19] > 0.1


def test_no_weight_decay_on_norms_and_embeddings():
    model = GPT(load_config(None, model="tiny").model_config(VOCAB))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all("norm" in names[id(p)] or "embed" in names[id(p)] for p in no_decay["params"])
    assert {names[id(p)] for p in decay["params"]} >= {"lm_head.weight",
                                                       "model.layers.0.self_attn.q_proj.weight"}


# ----------------------------------------------------------------------------------- resume


@pytest.mark.parametrize("moe", [False, True], ids=["dense-nvfp4-nvidia", "moe-lowrank"])
def test_resume_is_bit_exact(data, tmp_path, moe):
    # nvfp4-nvidia draws stochastic-rounding seeds from the RNG; lowrank refreshes its factors
    # every 3 forwards: both states must come back from the checkpoint for the curves to match.
    kw = ({"model": MOE, "recipe": FAST_LOWRANK} if moe else {"recipe": "nvfp4-nvidia"})
    full = train(config(data, tmp_path / "full", max_steps=8, **kw))
    train(config(data, tmp_path / "split", max_steps=4, lr_decay_steps=8, **kw))
    resumed = train(config(data, tmp_path / "split", max_steps=8, **kw), resume=True)
    a, b = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "split")
    assert [r["step"] for r in b] == list(range(1, 9))
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "grad_norm", "lr", "val_loss"):
            assert ra.get(key) == rb.get(key, ra.get(key)), (ra["step"], key)
    assert resumed["steps_this_run"] == 4 and resumed["final_val_loss"] == full["final_val_loss"]
    wa = load_file(str(latest_checkpoint(tmp_path / "full") / "model.safetensors"))
    wb = load_file(str(latest_checkpoint(tmp_path / "split") / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _counters(weights: dict) -> dict:
    # The low-rank refresh counters: the 0-d integer buffers of the weights.
    return {k: v for k, v in weights.items() if v.ndim == 0 and not v.is_floating_point()}


def test_resume_from_a_checkpoint_with_refresh_counters_in_state_json(data, tmp_path):
    # Checkpoints written before the counters were module state hold them in state.json and
    # not in the weights: resuming one puts them back; a checkpoint whose weights hold them
    # keeps its own. Dropping them instead changes the run (the test can fail).
    kw = {"recipe": FAST_LOWRANK, "max_steps": 8}
    train(config(data, tmp_path / "full", **kw))
    train(config(data, tmp_path / "split", max_steps=4, lr_decay_steps=8, recipe=FAST_LOWRANK))
    full = [r["loss"] for r in read_metrics(tmp_path / "full")]
    ckpt = latest_checkpoint(tmp_path / "split")
    weights = load_file(str(ckpt / "model.safetensors"))
    counters = _counters(weights)
    assert counters and all(int(v) == 8 for v in counters.values())  # 2 forwards a step
    rest = {k: v for k, v in weights.items() if k not in counters}
    legacy = {k.rpartition(".")[0]: int(v) for k, v in counters.items()}
    for name, old_state, old_weights in (("old", True, True), ("both", True, False),
                                         ("lost", False, True)):
        run = tmp_path / name
        shutil.copytree(tmp_path / "split", run)
        path = latest_checkpoint(run)
        state = json.loads((path / "state.json").read_text())
        if old_state:  # a bogus count where the weights hold the real one
            state["lowrank_counters"] = legacy if old_weights else dict.fromkeys(legacy, 1)
        (path / "state.json").write_text(json.dumps(state))
        if old_weights:
            save_file(rest, str(path / "model.safetensors"))
        train(config(data, run, **kw), resume=True)
        losses = [r["loss"] for r in read_metrics(run)]
        assert (losses == full) == (name != "lost"), name
    final = load_file(str(latest_checkpoint(tmp_path / "old") / "model.safetensors"))
    assert _counters(final) == _counters(
        load_file(str(latest_checkpoint(tmp_path / "full") / "model.safetensors")))


def test_high_precision_tail_switches_once_and_resumes_exactly(data, tmp_path):
    # fullstack: NVFP4 linears, a refitted low-rank branch, FP4 attention, AdamW4. Half of the
    # 8-step schedule runs in BF16 from step 5; a run stopped after the switch and resumed must
    # switch again and match the uninterrupted run bit for bit, and before the switch a run
    # without it is the same run.
    kw = dict(recipe="fullstack", high_precision_tail=0.5)
    assert config(data, tmp_path, **kw).switch_step == 4
    assert config(data, tmp_path, max_steps=5, lr_decay_steps=8, **kw).switch_step == 4
    full = train(config(data, tmp_path / "full", **kw))
    train(config(data, tmp_path / "split", max_steps=5, lr_decay_steps=8, **kw))
    train(config(data, tmp_path / "split", **kw), resume=True)
    plain = train(config(data, tmp_path / "plain", recipe="fullstack"))
    a, b, c = (read_metrics(tmp_path / d) for d in ("full", "split", "plain"))
    assert [r.get("high_precision", False) for r in a] == [False] * 4 + [True] * 4
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["loss"] for r in a[:4]] == [r["loss"] for r in c[:4]]
    assert all(ra["loss"] != rc["loss"] for ra, rc in zip(a[4:], c[4:], strict=True))
    assert full["switch_step"] == 4 and plain["switch_step"] is None
    assert full["final_val_loss"] != plain["final_val_loss"]
    # At the switch, the step-4 weights are evaluated both ways; a run that never switched has
    # its final weights evaluated with every quantizer off. A run ending before the switch
    # holds the step-4 weights: its final values are the switch step's.
    assert a[3]["val_loss"] == c[3]["val_loss"] != a[3]["val_loss_high_precision"]
    assert "val_loss_high_precision" not in c[3] and "val_loss_high_precision" in c[-1]
    assert full["final_val_loss_high_precision"] is None
    assert plain["final_val_loss_high_precision"] == c[-1]["val_loss_high_precision"]
    short = train(config(data, tmp_path / "short", max_steps=4, lr_decay_steps=8, **kw))
    assert short["final_val_loss"] == a[3]["val_loss"]
    assert short["final_val_loss_high_precision"] == a[3]["val_loss_high_precision"]


def test_compiled_training_is_eagers_run(data, tmp_path, capsys):
    # compile: the steps' forward and backward through torch.compile (inductor, on CPU here).
    # Inductor may fuse the float32 elementwise work differently, so the losses are eager's to
    # float32 rounding, not bit for bit; the checkpoint is the eager model's (same keys), and
    # the precision switch traces the model anew (its graphs quantize).
    kw = dict(recipe="nvfp4", high_precision_tail=0.5, max_steps=4)
    eager = train(config(data, tmp_path / "eager", **kw))
    compiled = train(config(data, tmp_path / "compiled", compile=True, **kw))
    assert "torch.compile" in capsys.readouterr().out
    a, b = (read_metrics(tmp_path / d) for d in ("eager", "compiled"))
    assert [r.get("high_precision", False) for r in b] == [False, False, True, True]
    np.testing.assert_allclose([r["loss"] for r in b], [r["loss"] for r in a], rtol=1e-4)
    np.testing.assert_allclose(compiled["final_val_loss"], eager["final_val_loss"], rtol=1e-4)
    keys = [set(load_file(next((tmp_path / d).glob("checkpoints/*/model.safetensors"))))
            for d in ("eager", "compiled")]
    assert keys[0] == keys[1] and not any("_orig_mod" in k for k in keys[1])
    with pytest.raises(ValueError, match="compile must be true, false or a torch.compile mode"):
        config(data, tmp_path, compile="fast")


def test_final_weights_are_evaluated_with_every_quantizer_off(data, tmp_path):
    # The value the trainer reports is the val loss of an unquantized GPT holding the final
    # weights (the low-rank factors are buffers a plain GPT does not have).
    cfg = config(data, tmp_path / "run", recipe="fullstack", max_steps=4)
    result = train(cfg)
    weights = load_file(str(latest_checkpoint(tmp_path / "run") / "model.safetensors"))
    plain = GPT(cfg.model_config(VOCAB))
    plain.load_state_dict({k: v for k, v in weights.items() if k in plain.state_dict()})
    env = trainer_mod.distributed.setup("cpu")
    chunks = trainer_mod.val_chunks(trainer_mod.open_data(cfg)[1], cfg, env)
    expected = trainer_mod.evaluate(plain, chunks, env, trainer_mod.nullcontext())
    assert result["final_val_loss_high_precision"] == expected != result["final_val_loss"]
    assert train(config(data, tmp_path / "bf16", max_steps=4))[
        "final_val_loss_high_precision"] is None


def _torch_modes() -> tuple:
    return (torch.are_deterministic_algorithms_enabled(),
            torch.backends.cuda.cudnn_sdp_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG"))


@pytest.mark.parametrize("kw", [{"recipe": "bf16", "model": MOE}, {"recipe": "fullstack"}],
                         ids=["bf16-moe", "fullstack"])
def test_deterministic_run_sets_and_restores_torch_modes(data, tmp_path, monkeypatch, kw):
    # Every op of these recipes must have a deterministic algorithm (torch raises otherwise),
    # the modes must hold while training and come back afterwards, even when training fails.
    seen = []
    real_clip = trainer_mod.clip_gradients

    def spy(*args, **kwargs):
        seen.append(_torch_modes())
        return real_clip(*args, **kwargs)

    monkeypatch.setattr(trainer_mod, "clip_gradients", spy)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = _torch_modes()
    runs = [train(config(data, tmp_path / f"r{i}", deterministic=True, max_steps=4, **kw))
            for i in range(2)]
    assert _torch_modes() == before
    assert seen and all(m == (True, False, CUBLAS_WORKSPACE) for m in seen)
    assert runs[0]["final_val_loss"] == runs[1]["final_val_loss"]
    assert json.loads((tmp_path / "r0" / "config.json").read_text())["deterministic"] is True

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(trainer_mod, "clip_gradients", fail)
    with pytest.raises(RuntimeError, match="boom"):
        train(config(data, tmp_path / "r2", deterministic=True, max_steps=2, **kw))
    assert _torch_modes() == before


def test_deterministic_algorithms_off_changes_nothing(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    before = _torch_modes()
    with deterministic_algorithms(False):
        assert _torch_modes() == before
    with deterministic_algorithms(True):
        assert _torch_modes() == (True, False, ":16:8")  # a user's workspace setting is kept
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
    with deterministic_algorithms(True, warn_only=True):
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert _torch_modes() == before and not torch.is_deterministic_algorithms_warn_only_enabled()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recipe", ["bf16", "fullstack-nvidia"])
def test_cuda_deterministic_runs_repeat_bitwise(data, tmp_path, recipe):
    # bf16 runs SDPA (cuDNN's backward varies from run to run; deterministic mode avoids it);
    # fullstack-nvidia runs the FP4 attention kernels, NVFP4 linears and AdamW4's kernels.
    kw = dict(recipe=recipe, device="cuda", deterministic=True, seq_len=256, max_steps=6,
              model={"preset": "tiny", "dim": 128, "n_layers": 2, "n_heads": 2,
                     "n_kv_heads": 1, "ffn_hidden": 256})
    train(config(data, tmp_path / "a", **kw))
    train(config(data, tmp_path / "b", **kw))
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r.get("loss") for r in a] == [r.get("loss") for r in b]
    assert [r.get("grad_norm") for r in a] == [r.get("grad_norm") for r in b]


def test_resume_guards(data, tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(config(data, tmp_path), resume=True)
    train(config(data, tmp_path, max_steps=2, warmup_steps=1))
    with pytest.raises(FileExistsError, match="--resume"):
        train(config(data, tmp_path, max_steps=4))
    with pytest.raises(ValueError, match="recipe is 'nvfp4' but the checkpoint"):
        train(config(data, tmp_path, max_steps=4, recipe="nvfp4"), resume=True)


# nvfp4 with a BF16 tail: the final weights were evaluated after the precision switch.
@pytest.mark.parametrize("kw", [{}, {"recipe": "nvfp4", "high_precision_tail": 0.5}],
                         ids=["bf16", "nvfp4-tail"])
def test_resume_of_a_finished_run_trains_nothing_and_keeps_its_result(data, tmp_path, capsys,
                                                                       kw):
    train(config(data, tmp_path, max_steps=4, warmup_steps=1, **kw))
    result_file = tmp_path / "result.json"
    saved, metrics = result_file.read_text(), (tmp_path / "metrics.jsonl").read_text()
    capsys.readouterr()
    again = train(config(data, tmp_path, max_steps=4, warmup_steps=1, **kw), resume=True)
    out = capsys.readouterr().out
    assert "nothing to train: the checkpoint is at step 4, the run's max_steps is 4" in out
    assert "done:" not in out
    assert result_file.read_text() == saved and again == json.loads(saved)
    assert (tmp_path / "metrics.jsonl").read_text() == metrics
    # Stopped between the final checkpoint and result.json: the checkpoint's result, no NaN.
    result_file.unlink()
    again = train(config(data, tmp_path, max_steps=4, warmup_steps=1, **kw), resume=True)
    first = json.loads(saved)
    assert again["steps_this_run"] == 0 and again["steps"] == 4
    assert again["final_val_loss"] == first["final_val_loss"]
    assert again["final_loss"] == first["final_loss"]
    assert again["final_val_loss_high_precision"] == first["final_val_loss_high_precision"]
    assert math.isfinite(again["tokens_per_s"]) and again["tokens_per_s"] > 0
    assert json.loads(result_file.read_text())["final_val_loss"] == first["final_val_loss"]
    assert "NaN" not in result_file.read_text()  # how json writes a NaN


def test_resume_with_max_steps_below_the_checkpoint_is_refused(data, tmp_path):
    train(config(data, tmp_path, max_steps=4, warmup_steps=1))
    saved = (tmp_path / "result.json").read_text()
    with pytest.raises(ValueError, match="at step 4, past max_steps 2; pass --max-steps 4 or "
                       "more"):
        train(config(data, tmp_path, max_steps=2, warmup_steps=1), resume=True)
    assert (tmp_path / "result.json").read_text() == saved


def test_crash_mid_save_keeps_previous_checkpoint(data, tmp_path, monkeypatch):
    real_save = ckpt_mod.save_file
    calls = []

    def crashing_save(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:  # the second checkpoint: write part of the file, then die
            Path(filename).write_bytes(b"partial")
            raise KeyboardInterrupt("killed mid-save")
        real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(ckpt_mod, "save_file", crashing_save)
    with pytest.raises(KeyboardInterrupt):
        train(config(data, tmp_path, max_steps=4, ckpt_every=2))
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_00000002"]
    assert any(p.name.startswith(".tmp-") for p in (tmp_path / "checkpoints").iterdir())
    good = latest_checkpoint(tmp_path)
    assert json.loads((good / "state.json").read_text())["step"] == 2
    assert load_file(str(good / "model.safetensors"))  # intact
    monkeypatch.setattr(ckpt_mod, "save_file", real_save)
    result = train(config(data, tmp_path, max_steps=4, ckpt_every=2), resume=True)
    assert result["steps_this_run"] == 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000002", "step_00000004"]  # the stale temporary directory is gone
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recipe", ["bf16", "nvfp4", "nvfp4-nvidia"])
def test_cuda_bf16_autocast_trains(data, tmp_path, recipe):
    result = train(config(data, tmp_path, recipe=recipe, device="cuda"))
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert all(math.isfinite(v) for v in losses) and np.mean(losses[-3:]) < losses[0] - 0.05
    assert result["device"].startswith("cuda") and result["peak_memory_gib"] > 0


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_compile_modes_are_refused(data, tmp_path, mode):
    # Replayed as CUDA graphs, the training step's backward read forward outputs overwritten by
    # the next replay on the H200 (torch 2.11, 2026-12-03): refused with the way out.
    with pytest.raises(ValueError, match="compile: true"):
        config(data, tmp_path, compile=mode)


# -------------------------------------------------------------------------------------- NaN


def poison(monkeypatch, steps: set[int], where: str) -> None:
    """Make training forward number `s` (0-based; one per step here) non-finite: its loss
    ("loss") or only its gradients ("grad")."""
    forward = GPT.forward
    count = {"n": 0}

    def patched(self, idx, targets=None, **kw):
        logits, loss = forward(self, idx, targets, **kw)
        if targets is not None and torch.is_grad_enabled():
            if count["n"] in steps:
                if where == "loss":
                    loss = loss * float("nan")
                else:
                    logits.register_hook(lambda g: torch.full_like(g, float("inf")))
            count["n"] += 1
        return logits, loss

    monkeypatch.setattr(GPT, "forward", patched)


@pytest.mark.parametrize("where", ["loss", "grad"])
def test_nonfinite_step_is_skipped(data, tmp_path, monkeypatch, where):
    poison(monkeypatch, {2}, where)
    result = train(config(data, tmp_path, max_steps=5, micro_batch_size=8))
    records = read_metrics(tmp_path)
    bad = records[2]
    assert bad["step"] == 3 and bad["skipped"] is True
    assert bad["reason"] == ("non-finite loss" if where == "loss" else "non-finite grad norm")
    assert all("skipped" not in r for i, r in enumerate(records) if i != 2)
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(records) if i != 2)
    assert result["nan_skips"] == 1 and math.isfinite(result["final_val_loss"])


def test_nonfinite_steps_stop_training(data, tmp_path, monkeypatch):
    poison(monkeypatch, set(range(2, 100)), "loss")
    with pytest.raises(NonFiniteLossError, match="max_nan_skips 2"):
        train(config(data, tmp_path, max_steps=10, micro_batch_size=8, max_nan_skips=2))
    records = read_metrics(tmp_path)
    assert [r.get("skipped", False) for r in records] == [False, False, True, True, True]
    assert records[-1]["loss"] == "nan"  # JSON has no NaN


# ----------------------------------------------------------------------------------- config


@pytest.mark.parametrize("change,match", [
    ({"lrr": 0.1}, "unknown key 'lrr'.*did you mean 'lr'"),
    ({"lr": 0.0}, "lr must be > 0"),
    ({"weight_decay": -1.0}, "weight_decay must be >= 0"),
    ({"lr": "3e-4"}, "lr must be a finite number.*3.0e-4"),
    ({"min_lr": 1.0}, r"min_lr must be in \[0, lr"),
    ({"betas": [0.9]}, "betas must be two numbers"),
    ({"global_batch_size": 10}, "global_batch_size 10 must be a multiple of micro_batch_size 4"),
    ({"max_steps": 0}, "max_steps must be an integer >= 1"),
    ({"recipe": "nvfp5"}, "recipe: unknown recipe 'nvfp5'"),
    ({"recipe": "nvfp4@sideways"}, "recipe: recipe scope 'sideways' is unknown"),
    ({"recipe": {"preset": "nvfp4", "w": {"blok": 1}}}, r"config: recipe\.w\.blok: unknown field"),
    ({"recipe": 4}, "recipe: a recipe is a preset name, a mapping or a Recipe"),
    ({"distributed": "zero3"}, "distributed must be one of"),
    ({"device": "tpu"}, "device must be auto"),
    ({"model": {"dimm": 32}}, r"model.dimm: unknown GPTConfig field.*did you mean 'dim'"),
    ({"model": "huge"}, "model preset 'huge' is unknown"),
    ({"model": {"dim": 30}}, "model: .*n_heads"),
    ({"model": {"preset": "tiny", "max_seq_len": 16}}, "max_seq_len 16 is smaller than seq_len"),
    ({"tensorboard": "yes"}, "tensorboard must be true or false"),
    ({"deterministic": 1}, "deterministic must be true or false"),
    ({"high_precision_tail": 1.0}, r"high_precision_tail .* in \[0, 1\), got 1.0"),
    ({"high_precision_tail": -0.1}, "high_precision_tail must be >= 0"),
    ({"high_precision_tail": "20%"}, "high_precision_tail must be a finite number"),
    ({"high_precision_tail": 0.2, "recipe": "w4a4"}, "high_precision_tail: recipe 'w4a4' packs"),
])
def test_config_errors_name_the_field(data, tmp_path, change, match):
    with pytest.raises(ValueError, match=match):
        config(data, tmp_path, **change)


def test_yaml_presets_and_overrides(tmp_path):
    presets = sorted((REPO / "configs" / "pretrain").glob("*.yaml"))
    assert {p.stem for p in presets} >= {"tiny", "tiny-moe", "small", "small-moe"}
    for path in presets:
        cfg = load_config(path)
        assert cfg.model_config(4096).vocab_size == 4096  # the data's vocabulary
    cfg = load_config(REPO / "configs/pretrain/tiny.yaml", recipe="nvfp4", max_steps=3,
                      out=str(tmp_path / "{recipe}"), seed=None)
    assert cfg.recipe == "nvfp4" and cfg.max_steps == 3 and cfg.out_dir == tmp_path / "nvfp4"
    bad = tmp_path / "bad.yaml"
    bad.write_text("seq_len: 128\nbatch_size: 8\n")
    with pytest.raises(ValueError, match=r"bad.yaml: unknown key 'batch_size'"):
        load_config(bad)
    with pytest.raises(ValueError, match="max_steps must be an integer >= 1"):
        load_config(REPO / "configs/pretrain/tiny.yaml", max_steps=0)
    with pytest.raises(ValueError, match="vocab_size 64 is smaller than the data's"):
        from_dict({"model": {"preset": "tiny", "vocab_size": 64}}).model_config(4096)


def test_missing_data_names_the_build_command(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="fp4stack data build"):
        train(from_dict({"data": str(tmp_path / "none"), "out": str(tmp_path / "out")}))
    monkeypatch.chdir(tmp_path)  # where runs/data/tiny, the presets' default, does not exist
    with pytest.raises(FileNotFoundError, match="data build --sources wikipedia --vocab-size "
                       "4096 --max-chars 3000000 --out runs/data/tiny"):
        train(load_config(REPO / "configs/pretrain/tiny.yaml", device="cpu"))


def test_cli_pretrain(data, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"model: {{preset: tiny, dim: 32, n_layers: 2, n_heads: 2, n_kv_heads: 1, "
        f"ffn_hidden: 64}}\ndata: {data}\nseq_len: 32\nglobal_batch_size: 4\n"
        "micro_batch_size: 4\nwarmup_steps: 1\nmax_steps: 10\ntensorboard: false\n")
    out = tmp_path / "runs" / "{recipe}"
    assert main(["pretrain", "--config", str(cfg), "--recipe", "qat-w", "--max-steps", "2",
                 "--out", str(out)]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "runs" / "qat-w")] == [2]
    assert main(["pretrain", "--config", str(cfg), "--recipe", "qat-w", "--max-steps", "3",
                 "--out", str(out), "--resume", "--deterministic"]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "runs" / "qat-w")] == [2, 3]
    assert json.loads((tmp_path / "runs" / "qat-w" / "config.json").read_text())["deterministic"]
    printed = capsys.readouterr().out
    assert "quantize_model: recipe qat-w" in printed
    assert "resuming with changed deterministic (False -> True)" in printed
    assert main(["pretrain", "--config", str(cfg), "--data", str(tmp_path / "none")]) == 2
    assert "fp4stack data build" in capsys.readouterr().err
    assert main(["pretrain", "--config", str(cfg), "--recipe", "nvfp5"]) == 2
    assert "unknown recipe 'nvfp5'" in capsys.readouterr().err
    # A recipe file: the mapping trains under its name; a bad one is refused naming the file.
    (tmp_path / "r.yaml").write_text("preset: qat-w\nname: qat-w46\nw: {four_over_six: true}\n")
    assert main(["pretrain", "--config", str(cfg), "--recipe", str(tmp_path / "r.yaml"),
                 "--max-steps", "1", "--out", str(out)]) == 0
    saved = json.loads((tmp_path / "runs" / "qat-w46" / "config.json").read_text())
    assert saved["recipe"]["w"] == {"four_over_six": True}
    (tmp_path / "bad.yaml").write_text("recipe: {preset: qat-w, w: {four_over_six: true}}\n")
    assert main(["pretrain", "--config", str(cfg), "--recipe", str(tmp_path / "bad.yaml")]) == 2
    assert "bad.yaml: recipe.name: required" in capsys.readouterr().err
    assert main(["pretrain", "--config", str(cfg), "--recipe", str(tmp_path / "no.yaml")]) == 2
    assert "recipe file" in capsys.readouterr().err


@pytest.mark.parametrize("optimizer", ["adamw4", "muon", "muon4", "root4"])
def test_nvfp4_state_optimizers_train_and_resume_exactly(data, tmp_path, optimizer):
    # dim 64: the 64x64 and 128x64 matrices are large enough (4096 values) for NVFP4 states.
    model = {"preset": "tiny", "dim": 64, "n_layers": 3, "n_heads": 2, "n_kv_heads": 1,
             "ffn_hidden": 128}
    kw = dict(model=model, optimizer=optimizer, muon_lr=0.02, lr=3e-3)
    full = train(config(data, tmp_path / "full", max_steps=4, **kw))
    train(config(data, tmp_path / "split", max_steps=2, lr_decay_steps=4, **kw))
    train(config(data, tmp_path / "split", max_steps=4, **kw), resume=True)
    a, b = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "split")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert a[-1]["loss"] < a[0]["loss"] and math.isfinite(full["final_val_loss"])


def test_unknown_optimizer_is_refused(data, tmp_path):
    with pytest.raises(ValueError, match="optimizer 'adam' is unknown"):
        config(data, tmp_path, optimizer="adam")
    with pytest.raises(ValueError, match=r"config: optimizer 4 is unknown; choose one of "
                                         r"\['adamw', 'muon', 'root'\] \(the recipe's "
                                         r"optimizer_states"):
        config(data, tmp_path, optimizer=4)
    with pytest.raises(ValueError, match=r"optimizer_states must be one of \['fp32', 'nvfp4'\], "
                                         "got 'fp16'"):
        resolve_optimizer("adamw", "fp16")


@pytest.mark.parametrize("optimizer", ["adamw4", "root4"])
def test_adamw4_transform_reaches_the_adamw4_states(data, tmp_path, optimizer):
    cfg = config(data, tmp_path, optimizer=optimizer, adamw4_transform="sqrt-center-hadamard")
    model = GPT(cfg.model_config(VOCAB))
    opt = build_from_config(model, cfg)
    adamw4 = opt if isinstance(opt, AdamW4) else opt.adamw
    assert adamw4.state_format.transform == "sqrt-center-hadamard"
    default = build_from_config(model, config(data, tmp_path, optimizer=optimizer))
    assert (default if isinstance(default, AdamW4) else default.adamw).state_format.transform \
        == "rank1"


def test_a_recipe_names_its_adamw4_transform_and_a_config_overrides_it(data, tmp_path):
    # fullstack-paper stores AdamW4's v as the paper does; a comparison can then run it beside
    # recipes that keep AdamW4's default, from one config.
    def transform(**fields):
        cfg = config(data, tmp_path, **fields)
        opt = build_from_config(GPT(cfg.model_config(VOCAB)), cfg)
        return (opt if isinstance(opt, AdamW4) else opt.adamw).state_format.transform

    assert get_recipe("fullstack-paper").adamw4_transform == "sqrt-center-hadamard"
    assert transform(recipe="fullstack-paper", optimizer="root4") == "sqrt-center-hadamard"
    assert transform(recipe="fullstack", optimizer="adamw4") == "rank1"
    assert transform(recipe="fullstack-paper", optimizer="adamw4",
                     adamw4_transform="sqrt") == "sqrt"
    with pytest.raises(ValueError, match="optimizer_states='nvfp4' too"):
        get_recipe("nvfp4").with_(adamw4_transform="sqrt")
    with pytest.raises(ValueError, match="adamw4_transform 'cube' is unknown"):
        config(data, tmp_path, recipe={"preset": "fullstack", "name": "fullstack-cube",
                                       "adamw4_transform": "cube"},
               optimizer="adamw4")


def test_bad_adamw4_transform_is_refused(data, tmp_path):
    with pytest.raises(ValueError, match=r"adamw4_transform 'hadamard' is unknown; choose one "
                                         r"of \[.*'sqrt-center-hadamard'"):
        config(data, tmp_path, optimizer="adamw4", adamw4_transform="hadamard")
    with pytest.raises(ValueError, match="adamw4_transform: optimizer 'root' with recipe 'bf16' "
                                         "keeps fp32 states"):
        config(data, tmp_path, optimizer="root", adamw4_transform="sqrt")


@pytest.mark.parametrize("optimizer,recipe,name", [
    ("adamw", "bf16", "adamw"), ("adamw", "fullstack", "adamw4"), ("adamw4", "bf16", "adamw4"),
    ("adamw4", "fullstack", "adamw4"), ("muon", "bf16", "muon"), ("muon", "fullstack", "muon4"),
    ("muon4", "bf16", "muon4"), ("muon4", "fullstack", "muon4"), ("root", "bf16", "root"),
    ("root", "fullstack", "root4"), ("root4", "bf16", "root4")])
def test_optimizer_is_the_configs_with_the_recipes_states(data, tmp_path, optimizer, recipe, name):
    # The config names the algorithm, the recipe the state format; adamw4 and muon4 (older
    # configs) name NVFP4 states whatever the recipe.
    cfg = config(data, tmp_path, optimizer=optimizer, recipe=recipe)
    choice = optimizer_of(cfg)
    assert choice == OptimizerChoice(optimizer.rstrip("4"), "nvfp4" if "4" in name else "fp32")
    assert choice.name == name
    model = GPT(cfg.model_config(VOCAB))
    opt = build_optimizer(model, choice, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                          weight_decay=cfg.weight_decay, muon_lr=0.02, seed=0)
    kind = {"adamw": torch.optim.AdamW, "adamw4": AdamW4, "muon": Muon4, "muon4": Muon4,
            "root": ROOT, "root4": ROOT}[name]
    assert type(opt) is kind and all("lr_scale" in g for g in opt.param_groups)
    if kind in (Muon4, ROOT):
        assert opt.quantize == name.endswith("4")
        assert {g["lr_scale"] for g in opt.param_groups} == {1.0, 0.02 / cfg.lr}


@pytest.mark.parametrize("recipe", ["fullstack", "fullstack-nvidia-noreuse",
                                    "fullstack-nvidia-hp-backward", "fullstack-nvidia-reblock",
                                    "fullstack-nvidia-tiles", "fullstack-nvidia-rotated",
                                    "fullstack-nvidia-fresh-sr", "fullstack-nvidia-sr-qkv",
                                    "fullstack-nvidia-noreuse-last-bf16",
                                    "fullstack-nvidia-noreuse-w1x16-4over6"])
def test_fullstack_recipe_trains_with_nvfp4_states_and_fp4_attention(data, tmp_path, recipe):
    result = train(config(data, tmp_path, recipe=recipe, max_steps=3))
    assert result["optimizer"] == "adamw4" and math.isfinite(result["final_val_loss"])


def test_recipe_mapping_names_the_run(data, tmp_path):
    mapping = {"preset": "nvfp4-nvidia", "name": "x-4over6", "x": {"four_over_six": True}}
    cfg = config(data, tmp_path / "{recipe}", recipe=mapping, max_steps=2)
    assert cfg.recipe_name == "x-4over6" and cfg.out_dir == tmp_path / "x-4over6"
    result = train(cfg)
    assert result["recipe"] == "x-4over6" and math.isfinite(result["final_val_loss"])
    saved = json.loads((cfg.out_dir / "config.json").read_text())
    assert saved["recipe"] == mapping  # the run's config says what its recipe was


def test_fullstack_nvidia_presets_are_fullstack_on_nvidias_quantizers():
    """The -nvidia full stacks: NVIDIA's linear quantizers on every block (none kept in BF16),
    fullstack's low-rank branch and NVFP4 states, and the attention their names say."""
    linear = ("x", "w", "dy", "w_dgrad", "x_wgrad", "dy_wgrad")
    nvidia, fullstack = get_recipe("nvfp4-nvidia"), get_recipe("fullstack")
    reuse = {"fullstack-nvidia": True, "fullstack-nvidia-noreuse": False,
             "fullstack-nvidia-reuse-v": ("v",), "fullstack-nvidia-reuse-qk": ("q", "k"),
             "fullstack-nvidia-hp-backward": False, "fullstack-nvidia-reblock": True,
             "fullstack-nvidia-tiles": True, "fullstack-nvidia-rotated": True,
             "fullstack-nvidia-rotated-noreuse": False, "fullstack-nvidia-fresh-sr": False,
             "fullstack-nvidia-noreuse-sr": False, "fullstack-nvidia-sr-qkv": True,
             "fullstack-nvidia-sr-qkv-noreuse": False, "fullstack-nvidia-noreuse-delta": False}
    for name, want in reuse.items():
        r = get_recipe(name)
        assert r.name == name
        assert all(getattr(r, f) == getattr(nvidia, f) for f in linear), name
        assert r.keep_first_blocks == r.keep_last_blocks == 0
        assert r.lowrank == fullstack.lowrank and r.optimizer_states == "nvfp4"
        hp, reblock = name.endswith("hp-backward"), name.endswith("reblock")
        qkv = NVFP4_TILES if name.endswith("tiles") else NVFP4_SR if "sr-qkv" in name else None
        specs = dict.fromkeys("qkv", qkv) if qkv else {}
        rotate, sr = "rotated" in name, name.endswith("-sr")
        how = {"requantize_rounding": "stochastic"} if sr else {}
        if name.endswith("fresh-sr"):
            how["requantize_along"] = "forward"
        delta = "dp" if name.endswith("delta") else "output"
        assert r.attention == AttentionAblation.quant(
            reuse=want, requantize=not hp, reblock=reblock, rotate_qk=rotate, delta=delta,
            **specs, **how), name
        assert ("Hadamard-rotated" in r.attention.describe()) == rotate, name
        assert r.attention.describe().count("16x16 tiles") == (
            3 if name.endswith("tiles") else 0), name
    lowrank = get_recipe("lowrank-nvidia")
    assert all(getattr(lowrank, f) == getattr(nvidia, f) for f in linear)
    # The linear variants of the best full stack differ from it in the field their names say.
    base = get_recipe("fullstack-nvidia-noreuse")
    lora = get_recipe("fullstack-nvidia-noreuse-lora")
    assert lora == base.with_(name=lora.name, lowrank=LowRank(trainable=True))
    four_six = get_recipe("fullstack-nvidia-noreuse-4over6")
    assert four_six == base.with_(name=four_six.name, x=replace(base.x, four_over_six=True),
                                  w=replace(base.w, four_over_six=True))
    assert four_six.w.block == (16, 16) and four_six.x.block == (1, 16)
    rne = base.x
    w1x16 = get_recipe("fullstack-nvidia-noreuse-w1x16")
    assert w1x16 == base.with_(name=w1x16.name, w=rne, w_dgrad=rne)
    assert w1x16.w.block == (1, 16) and base.w.block == (16, 16) and base.w_dgrad is None
    w1x16_46 = get_recipe("fullstack-nvidia-noreuse-w1x16-4over6")
    four_six_1x16 = replace(rne, four_over_six=True)
    assert w1x16_46 == w1x16.with_(name=w1x16_46.name, x=four_six_1x16, w=four_six_1x16)
    last = get_recipe("fullstack-nvidia-noreuse-last-bf16")
    assert last == base.with_(name=last.name, keep_last_blocks=1) and last.keep_first_blocks == 0
    assert lowrank.attention is None and lowrank.optimizer_states == "fp32"


def test_checkpoint_files_follow_the_umask(tmp_path):
    from fp4stack.train.distributed import DistEnv

    model = torch.nn.Linear(4, 4)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
                  owns_group=False)
    old = os.umask(0o022)
    try:
        path = ckpt_mod.save_checkpoint(tmp_path, 1, model, torch.optim.AdamW(model.parameters()),
                                        {}, env, keep=1)
    finally:
        os.umask(old)
    assert {p.stat().st_mode & 0o777 for p in path.iterdir()} == {0o644}, sorted(
        (p.name, oct(p.stat().st_mode)) for p in path.iterdir())
