"""The rollout engine in its own process (`engine_device: process`), on CPU with gloo: the
message transport, the refit's checks across the process boundary, and a whole two-process GRPO
run equal to one process's, metric for metric."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4stack.convert import quantize_model
from fp4stack.data.char_tokenizer import CharTokenizer
from fp4stack.models import GPT, GPTConfig
from fp4stack.rl import remote
from fp4stack.rl.config import RLConfig
from fp4stack.rl.rollout import RolloutEngine
from fp4stack.rl.sync import (
    WeightSyncError,
    export_update,
    export_weights,
    load_weights,
    refit_plan,
)
from fp4stack.rl.trainer import run_rl

REPO = Path(__file__).resolve().parents[1]
TOK = CharTokenizer()
PROMPTS = [TOK.encode(p) for p in ("12+34=", "7+5=", "40+41=", "3+3=")]


def policy(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.tiny_moe(vocab_size=TOK.vocab_size, max_seq_len=32)).eval()


def odd_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"f32": torch.randn(3, 5, generator=g), "bf16": torch.randn(7, generator=g).bfloat16(),
            "bool": torch.rand(4, 3, generator=g) > 0.5, "u8": torch.arange(13, dtype=torch.uint8),
            "fp8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
            "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
            "i64": torch.arange(9).reshape(3, 3).t(),  # not contiguous
            "big": torch.randn(300, generator=g)}


def _transport_worker(rank: int, port: int, failures) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        remote.BUCKET_BYTES = 512  # several buckets, "big" alone in one larger than the limit
        cpu = torch.device("cpu")
        if rank == 0:
            remote.send(("hello", {"k": 1}), 1, odd_tensors())
            remote.send(("nothing",), 1)
        else:
            header, got = remote.recv(0, cpu)
            want = odd_tensors()
            assert header == ("hello", {"k": 1})
            assert list(got) == list(want)
            for name, t in want.items():
                assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
                # bit for bit (fp8 has no torch.equal)
                assert torch.equal(got[name].reshape(-1).view(torch.uint8),
                                   t.contiguous().reshape(-1).view(torch.uint8)), name
            assert remote.recv(0, cpu) == (("nothing",), {})
        _engine_round_trip(rank)
    except BaseException as e:  # reported to the parent: a worker's assert is not a test's
        failures.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        dist.destroy_process_group()


def _engine_round_trip(rank: int) -> None:
    # Rank 1 serves an NVFP4 engine; rank 0 refits it, has a corrupted refit refused (and the
    # engine stay up), and samples from it: the tokens of a same-process engine with the same
    # seed and weights.
    base = policy()
    if rank == 1:
        engine = RolloutEngine(base, TOK, "quads", max_new_tokens=4)
        remote.serve(engine, torch.Generator().manual_seed(7), "reference")
        return
    local = RolloutEngine(base, TOK, "quads", max_new_tokens=4)
    quantize_model(base, "qat-w")
    with torch.no_grad():
        for p in base.parameters():
            p.add_(0.01 * torch.randn_like(p))
    handle = remote.RemoteEngine(TOK, torch.device("cpu"))
    assert handle.plan == refit_plan(local.model, local.amax_groups)
    assert handle.sync(base) == local.sync(base) > 0
    bad = export_update(base, handle.plan)
    name = "model.layers.1.mlp.experts.gate_up_data"
    bad.tensors[name] = bad.tensors[name].clone()
    bad.tensors[name][1, 2, 3] ^= 0x01
    with pytest.raises(WeightSyncError, match=r"rank 1.*mlp\.experts\.gate_up\[1\]"):
        handle._call(("sync", bad.checksums), bad.tensors)
    assert handle.sync(base) > 0  # still serving, refitted again
    got = handle.generate(PROMPTS * 2, torch.Generator(), record=True)
    want = local.generate(PROMPTS * 2, torch.Generator().manual_seed(7), record=True)
    for field in ("tokens", "mask", "response_mask", "logprobs"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert got.prompt_len == want.prompt_len
    assert got.routing.keys() == want.routing.keys()
    assert all(torch.equal(got.routing[k], want.routing[k]) for k in want.routing)
    handle.temperature = 0.0  # greedy, as evaluate() asks
    local.temperature = 0.0
    assert torch.equal(handle.generate(PROMPTS).tokens, local.generate(PROMPTS).tokens)
    with pytest.raises(RuntimeError, match="rank 1.*ValueError.*non-empty"):
        handle.generate([[]], None)
    handle.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_messages_engine_refits_and_rollouts_cross_the_process_boundary():
    ctx = mp.get_context("spawn")
    failures = ctx.SimpleQueue()
    # A worker's failure is in `failures` (with its message), not in the exception
    with contextlib.suppress(mp.ProcessRaisedException):
        mp.start_processes(_transport_worker, args=(free_port(), failures), nprocs=2,
                           start_method="spawn")
    errors = []
    while not failures.empty():
        errors.append(failures.get())
    assert not errors, errors


def test_the_refit_plan_is_the_engines_own_and_pickles():
    base = policy()
    engine = RolloutEngine(base, TOK, "quads")
    quantize_model(base, "qat-w")
    plan = engine.refit_plan()
    assert pickle.loads(pickle.dumps(plan)) == plan
    sent = {n for m in plan.packed for s in m.slots for n in (m.prefix + k for k in s.keys)}
    copied = {n for n, _ in plan.copied}
    state = engine.model.state_dict()
    engine_only = {n for n in state if n.rpartition(".")[2].startswith(("x_amax", "rc_channels"))}
    weight_amax = {m.prefix + "weight_amax" for m in plan.packed if m.sets_weight_amax}
    # every engine tensor is sent exactly once, or calibrated by the engine itself
    assert not (sent & copied) and sent | copied | weight_amax | engine_only == set(state)
    # the plan's update is export_weights' (the one-process path), tensor for tensor
    a, b = export_update(base, plan), export_weights(base, engine.model, engine.amax_groups)
    assert a.checksums == b.checksums and a.tensors.keys() == b.tensors.keys()
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    assert load_weights(engine.model, a) == len(a.checksums)


def test_engine_process_needs_a_two_process_torchrun(tmp_path):
    cfg = RLConfig(policy={"kind": "gpt", "preset": "tiny-moe"}, task="arithmetic:add",
                   engine_device="process", device="cpu", out=str(tmp_path / "r"))
    with pytest.raises(ValueError, match="torchrun --nproc_per_node=2"):
        run_rl(cfg, log=lambda *a: None)


CONFIG = """\
policy: {kind: gpt, preset: tiny-moe, moe_hidden: 32}
task: arithmetic:add
task_options: {level: 1, n_test: 16}
sft_steps: 20
sft_lr: 3.0e-3
sft_batch_size: 16
rollout: quads
trainer: qat-w
compensation_mode: static
calibration_size: 8
routing_replay: true
engine: fast
off_policy: 1
steps: 3
prompts_per_step: 4
group_size: 4
max_new_tokens: 4
lr: 3.0e-5
eval_every: 2
eval_size: 16
device: cpu
"""


def rl_run(config: Path, out: Path, nproc: int) -> list[dict]:
    launch = ([] if nproc == 1 else
              ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"])
    cmd = [sys.executable, *launch, "-m", "fp4stack.cli", "rl", "--config", str(config),
           "--out", str(out), "--engine-device", "same" if nproc == 1 else "process"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_two_process_run_is_the_one_process_run(tmp_path):
    # The fast engine one step off-policy, static compensation (the engine calibrates), routing
    # replay (the rollout's experts cross back): every metric of every step equal, evaluations
    # included. (The reference engine crosses in the test above.)
    config = tmp_path / "rl.yaml"
    config.write_text(CONFIG)
    one = rl_run(config, tmp_path / "one", 1)
    two = rl_run(config, tmp_path / "two", 2)
    keys = ("step", "reward", "k3", "logp_diff_max", "response_len", "loss", "grad_norm",
            "pass_at_1", "synced_tensors")
    assert [{k: r.get(k) for k in keys} for r in two] == [{k: r.get(k) for k in keys}
                                                          for r in one]
    assert len(one) == 4 and one[-1]["synced_tensors"] > 0
    result = json.loads((tmp_path / "two" / "result.json").read_text())
    assert "rank 1" in result["engine_device"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.sampled_from(
    [torch.uint8, torch.bool, torch.bfloat16, torch.float32, torch.int64])), max_size=12),
       st.integers(16, 1024))
def test_the_layout_packs_every_tensor_once_aligned_within_its_bucket(sizes, bucket):
    tensors = {f"t{i}": torch.empty(n, dtype=dtype) for i, (n, dtype) in enumerate(sizes)}
    old, remote.BUCKET_BYTES = remote.BUCKET_BYTES, bucket
    try:
        layout = remote._layout(tensors)
    finally:
        remote.BUCKET_BYTES = old
    assert [e[0] for entries, _ in layout for e in entries] == list(tensors)  # once, in order
    for entries, size in layout:
        end = 0
        for name, dtype, shape, offset in entries:
            t = tensors[name]
            assert (dtype, shape) == (t.dtype, tuple(t.shape))
            assert offset % 16 == 0 and offset >= end  # aligned, no overlap
            end = offset + t.numel() * t.element_size()
        assert end <= size and size % 16 == 0
        # a bucket over the limit holds one tensor that is larger than the limit on its own
        assert size <= bucket or len(entries) == 1
