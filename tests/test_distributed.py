"""`torchrun --nproc_per_node=2 -m fp4stack.cli pretrain` on CPU (gloo): DDP and FSDP2 follow a
single process that trains on the same global batches.

Each rank takes rows rank::2 of every global batch, and gradients are averaged across ranks, so
the two runs compute the same function; only the order of fp32 sums differs (per-rank
micro-batches, then the all-reduce or reduce-scatter). That rounds differently by ~1e-7 relative
per operation; after a few AdamW steps the losses differ by ~2e-7 relative and the gradient norms
by ~3e-6 (measured). The tolerances below (1e-5 on losses, 1e-4 on gradient norms and weights)
leave a margin of ~30x while still catching any real divergence (a wrong row split, a missing
all-reduce or a doubled gradient move the loss by > 1e-3 within two steps).

Each rank runs whole micro-batches of the global batch, the same rows a single process puts in
each, with stochastic rounding drawn from a stream named by (seed, step, micro-batch): so an FP4
recipe's quantizers (per-tensor activation scales over a micro-batch's rows, the whole weight's
amax under FSDP2's sharding, stochastically rounded gradients) and an MoE's load-balance loss
compute the same values as in one process, and the runs agree as closely as BF16's until a
value near a rounding boundary of the quantizer flips (measured: never in six DDP steps of
nvfp4-nvidia; from step 4 under FSDP2, moving the loss by ~1e-4).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train import make_data

from fp4stack.train import load_config, read_metrics, train
from fp4stack.train.checkpoint import latest_checkpoint

REPO = Path(__file__).resolve().parents[1]
STEPS = 6


def write_config(root: Path, data: Path, model: str = "preset: tiny", recipe: str = "bf16"
                 ) -> Path:
    path = root / "dist.yaml"
    path.write_text(
        f"model: {{{model}, dim: 32, n_layers: 3, n_heads: 2, n_kv_heads: 1, ffn_hidden: 64}}\n"
        f"data: {data}\nseq_len: 32\nglobal_batch_size: 8\nmicro_batch_size: 2\n"
        f"lr: 1.0e-2\nmin_lr: 1.0e-3\nwarmup_steps: 2\nmax_steps: {STEPS}\neval_every: 3\n"
        f"eval_batches: 3\nlog_every: 1\nckpt_every: 3\nrecipe: {recipe}\ntensorboard: false\n"
        "device: cpu\n")
    return path


def torchrun(config: Path, out: Path, mode: str, *more: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "fp4stack.cli", "pretrain", "--config", str(config), "--out", str(out),
           "--distributed", mode, *more]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dist")
    config = write_config(root, make_data(root / "data"))
    train(load_config(config, out=str(root / "single")))
    for mode in ("ddp", "fsdp2"):
        torchrun(config, root / mode, mode)
    return {"config": config, "single": root / "single", "ddp": root / "ddp",
            "fsdp2": root / "fsdp2"}


def assert_close_runs(a: list[dict], b: list[dict], exact_steps: int = STEPS,
                      flipped: float = 1e-3) -> None:
    """Losses within 1e-5 and gradient norms within 1e-4 (fp32 sum order) for the first
    `exact_steps` steps; after them, within `flipped` (a quantized value has flipped)."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        exact = ra["step"] <= exact_steps
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5 if exact else flipped), ra
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"],
                                                rel=1e-4 if exact else 10 * flipped), ra
        assert rb["lr"] == ra["lr"]
        assert ("val_loss" in ra) == ("val_loss" in rb)
        if "val_loss" in ra:
            assert rb["val_loss"] == pytest.approx(ra["val_loss"],
                                                   rel=1e-5 if exact else flipped)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_processes_match_one(runs, mode):
    single, dist = read_metrics(runs["single"]), read_metrics(runs[mode])
    assert len(single) == STEPS
    assert single[-1]["loss"] < single[0]["loss"]
    assert_close_runs(single, dist)
    # The checkpoint holds the full (gathered) weights, whatever the sharding.
    wa = load_file(str(latest_checkpoint(runs["single"]) / "model.safetensors"))
    wb = load_file(str(latest_checkpoint(runs[mode]) / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        # Relative Frobenius error: AdamW's m / sqrt(v) turns rounding-level differences of tiny
        # gradient entries into differences of up to ~1e-3 of a step in single elements
        # (measured 6e-6 absolute at lr 1e-2), while whole tensors agree to ~1.5e-5.
        assert ((wb[k] - wa[k]).norm() / wa[k].norm()).item() < 1e-4, k
    rngs = sorted(p.name for p in latest_checkpoint(runs[mode]).glob("rng_rank*.pt"))
    assert rngs == ["rng_rank0.pt", "rng_rank1.pt"]


def test_fsdp2_checkpoint_resumes_in_one_process(runs):
    # Resuming the sharded run in a single process continues like the single-process run does:
    # the gathered optimizer state and weights are complete and correctly keyed.
    more = {"max_steps": STEPS + 2}
    train(load_config(runs["config"], out=str(runs["single"]), **more), resume=True)
    train(load_config(runs["config"], out=str(runs["fsdp2"]), **more), resume=True)
    assert_close_runs(read_metrics(runs["single"]), read_metrics(runs["fsdp2"]))


def test_fsdp2_nvfp4_all_gather_trains_as_the_fp32_all_gather(tmp_path):
    """fsdp_gather: nvfp4 (each rank's rows of the FP4 linear weights quantized and all-gathered
    as NVFP4 bytes): the same losses, gradient norms, validation losses (with every quantizer
    off too: W gathered for it) and checkpointed weights as FSDP2's fp32 all-gather, exactly,
    here with nvfp4's column-wise dgrad copies; and it resumes from its checkpoint."""
    config = write_config(tmp_path, make_data(tmp_path / "data"), recipe="nvfp4",
                          model="preset: tiny, n_kv_heads: 2")  # k/v rows: 32, two 16-row blocks
    config.write_text(config.read_text().replace("n_kv_heads: 1, ", ""))
    torchrun(config, tmp_path / "fp32", "fsdp2")
    torchrun(config, tmp_path / "nvfp4", "fsdp2", "--fsdp-gather", "nvfp4")
    a, b = read_metrics(tmp_path / "fp32"), read_metrics(tmp_path / "nvfp4")
    assert a == [{**r, "tokens_per_s": ra["tokens_per_s"]} for r, ra in zip(b, a, strict=True)]
    assert "val_loss_high_precision" in a[-1]
    wa = load_file(str(latest_checkpoint(tmp_path / "fp32") / "model.safetensors"))
    wb = load_file(str(latest_checkpoint(tmp_path / "nvfp4") / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    torchrun(config, tmp_path / "nvfp4", "fsdp2", "--fsdp-gather", "nvfp4", "--resume",
             "--max-steps", str(STEPS + 2))
    resumed = read_metrics(tmp_path / "nvfp4")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 3))
    assert resumed[:STEPS] == b


def test_fp4_moe_runs_match_one_process(tmp_path):
    """nvfp4-nvidia (2-D weight blocks, stochastically rounded gradients, Hadamard-transformed
    wgrad operands) on an MoE: both wrappings equal one process as BF16 does, to step 3."""
    config = write_config(tmp_path, make_data(tmp_path / "data"),
                          model="preset: tiny-moe, moe_hidden: 32", recipe="nvfp4-nvidia")
    train(load_config(config, out=str(tmp_path / "single")))
    single = read_metrics(tmp_path / "single")
    for mode in ("ddp", "fsdp2"):
        torchrun(config, tmp_path / mode, mode)
        assert_close_runs(single, read_metrics(tmp_path / mode), exact_steps=3)


def test_compiled_fsdp2_nvfp4_matches_eager_one_process(tmp_path):
    """compile: true under FSDP2 (each rank's forward and backward through torch.compile,
    the blocks sharded), with the fp32 and the NVFP4 all-gather: the losses and gradient norms
    of one eager process. The recipe is nvfp4's linears with a low-rank branch refitted every
    second training forward: the compiled refit op, which under the NVFP4 all-gather gathers
    W from the ranks' rows."""
    recipe = "{preset: lowrank, name: lowrank-r2, lowrank: {refresh_every: 2}}"
    config = write_config(tmp_path, make_data(tmp_path / "data"),
                          model="preset: tiny, n_layers: 1, n_kv_heads: 2", recipe=recipe)
    text = config.read_text().replace("n_layers: 3, ", "").replace("n_kv_heads: 1, ", "")
    config.write_text(text.replace(f"max_steps: {STEPS}", "max_steps: 2"))
    train(load_config(config, out=str(tmp_path / "single")))
    config.write_text(config.read_text() + "compile: true\n")
    # Step 2 follows a refit from weights that compiled maths rounded otherwise: a quantized
    # value may flip there (measured: 1.5e-4 relative in the loss).
    torchrun(config, tmp_path / "fsdp2", "fsdp2")
    assert_close_runs(read_metrics(tmp_path / "single"), read_metrics(tmp_path / "fsdp2"),
                      exact_steps=1)
    # The NVFP4 all-gather's forward compiled too (its amax refresh runs eagerly before it):
    # the same bits as the fp32 all-gather's compiled run, which a graph that fell back to
    # eager in part (a layer's frame apart, recompiled per layer) would not give.
    torchrun(config, tmp_path / "gather", "fsdp2", "--fsdp-gather", "nvfp4")
    a, b = read_metrics(tmp_path / "fsdp2"), read_metrics(tmp_path / "gather")
    assert a == [{**r, "tokens_per_s": ra["tokens_per_s"]} for r, ra in zip(b, a, strict=True)]
    wa = load_file(str(latest_checkpoint(tmp_path / "fsdp2") / "model.safetensors"))
    wb = load_file(str(latest_checkpoint(tmp_path / "gather") / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# Where each optimizer keeps a rank's NVFP4 states in its state_dict, and one such state's key.
PACKED = {"adamw4": (lambda sd: sd["inner"]["state"], "exp_avg_sq_data"),
          "muon4": (lambda sd: sd["state"], "momentum_data")}


@pytest.mark.parametrize("optimizer", list(PACKED))
def test_fsdp2_shards_nvfp4_optimizer_states_and_resumes_them_exactly(tmp_path, optimizer):
    """AdamW4 under FSDP2 steps each rank's rows with their own NVFP4 moments; Muon4 keeps
    each rank's rows of the momentum in NVFP4 and gathers a sharded matrix's update for its
    Newton-Schulz step. Training follows one process's (the same methods at another scale
    granularity), the checkpoint holds both ranks' NVFP4 states, and a resume continues bit for
    bit; a single process cannot take those states."""
    config = write_config(tmp_path, make_data(tmp_path / "data"), recipe="nvfp4")
    text = config.read_text().replace("dim: 32", "dim: 64").replace("ffn_hidden: 64",
                                                                      "ffn_hidden: 256")
    config.write_text(text + f"optimizer: {optimizer}\nkeep_checkpoints: 4\n")
    train(load_config(config, out=str(tmp_path / "single")))
    torchrun(config, tmp_path / "fsdp2", "fsdp2")
    single, sharded = read_metrics(tmp_path / "single"), read_metrics(tmp_path / "fsdp2")
    # Step 1 precedes any update; then the per-shard NVFP4 moments differ from the whole
    # matrix's by their rounding (measured: losses within 0.1%, gradient norms within 3%).
    assert_close_runs(single, sharded, exact_steps=1, flipped=1e-2)
    saved = torch.load(tmp_path / "fsdp2" / "checkpoints" / "step_00000003" / "optimizer.pt",
                       weights_only=True)
    ranks = saved["shard_local"]
    assert [r["rank"] for r in ranks] == [0, 1] and saved["world_size"] == 2
    states, key = PACKED[optimizer]
    packed = [k for r in ranks for st in states(r).values() for k in st if k == key]
    assert len(packed) >= 2 * 3 * 2  # each rank: 3 blocks' MLP matrices at least
    # Resume the sharded run from its step-3 checkpoint: steps 4-6 as the uninterrupted run.
    again = tmp_path / "again"
    shutil.copytree(tmp_path / "fsdp2" / "checkpoints" / "step_00000003",
                    again / "checkpoints" / "step_00000003")
    torchrun(config, again, "fsdp2", "--resume")
    resumed = {r["step"]: r for r in read_metrics(again)}
    for r in sharded[3:]:
        assert (resumed[r["step"]]["loss"], resumed[r["step"]]["grad_norm"]) == (
            r["loss"], r["grad_norm"])
    with pytest.raises(ValueError, match="sharded over 2 FSDP2 ranks; this run has 1 process"):
        train(load_config(config, out=str(tmp_path / "fsdp2"), max_steps=8), resume=True)


def test_scaling_benchmark_reads_the_runs(runs):
    """benchmarks/bench_distributed.py: its commands, and its summary of a one-process and a
    two-process run (per-GPU efficiency, the loss curves' largest relative difference)."""
    from scripts import load_script

    bench = load_script("benchmarks/bench_distributed.py")
    one = bench.command("c.yaml", "nvfp4", "fsdp2", 1, 5, Path("o"), [])
    two = bench.command("c.yaml", "nvfp4", "fsdp2", 2, 5, Path("o"), ["--compile"])
    assert "torch.distributed.run" not in one and "--distributed" not in one
    assert two[2:5] == ["torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert two[-3:] == ["--compile", "--distributed", "fsdp2"]
    gather = bench.command("c.yaml", "nvfp4", "fsdp2-nvfp4", 2, 5, Path("o"), [])
    assert gather[-4:] == ["--distributed", "fsdp2", "--fsdp-gather", "nvfp4"]
    # The first STEPS steps (the resume test above may have added two to the single run).
    single, ddp = (bench.read_steps(runs[k])[:STEPS] for k in ("single", "ddp"))
    row = bench.summarize(single, ddp, 2, skip=1)
    assert row["steps"] == list(range(1, STEPS + 1)) and row["max_rel_loss_diff"] < 1e-5
    rate = statistics.median(r["tokens_per_s"] for r in ddp[1:])
    assert row["efficiency"] == pytest.approx(
        rate / 2 / statistics.median(r["tokens_per_s"] for r in single[1:]))
