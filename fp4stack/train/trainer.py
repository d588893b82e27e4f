"""The pretraining loop: GPT + recipe + optimizer on token shards, single process, DDP or FSDP2.

    from fp4stack.train import load_config, train
    result = train(load_config("configs/pretrain/tiny.yaml", recipe="nvfp4"))

Every recipe of a comparison sees the same init (seeded), the same batches (a pure function of
the step) and the same validation tokens, so their loss curves differ only by the recipe. A run
resumed from a checkpoint reproduces the uninterrupted run's losses bit for bit on CPU. A step
whose loss or gradient norm is not finite is skipped (logged with the reason); too many in a row
stop training with NonFiniteLossError.

`start_run` builds a `Run` (what is trained and the counters a step moves); the loop calls, per
step, `switch_precision` (once, at high_precision_tail), `train_step`, `evaluate_step`,
`log_step` and `save_run`, each when its config field says.
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from ..convert import high_precision, to_high_precision
from ..formats.random import stream_seed
from ..nn.operands import weight_operands_once
from ..nn.recipe import recipe as get_recipe
from . import distributed
from .checkpoint import save_checkpoint
from .config import PretrainConfig
from .determinism import deterministic_algorithms
from .evaluation import evaluate, val_chunks
from .metrics import read_metrics
from .optimizers import set_lr
from .run import Run, build_model, compile_for_training, open_data, start_run
from .schedule import lr_at

# open_data, build_model and val_chunks: imported from here by scripts and tests.
__all__ = ["NonFiniteLossError", "Run", "build_model", "clip_gradients", "evaluate",
           "forward_backward", "open_data", "start_run", "train", "val_chunks"]


class NonFiniteLossError(RuntimeError):
    """Training stopped: too many consecutive steps had a non-finite loss or gradient norm."""


def forward_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro: int,
                     ddp: bool, autocast, seeds: list[int] | None = None) -> torch.Tensor:
    """Accumulate the gradients of this rank's rows of one global batch, `micro` rows per
    forward; returns their mean loss (detached). `seeds`: one per micro-batch, the CPU
    generator's seed before it (the stochastic rounding's seeds are drawn from it)."""
    accum = len(x) // micro
    if seeds is not None and len(seeds) != accum:
        raise ValueError(f"forward_backward: {len(seeds)} seeds for {accum} micro-batches")
    loss_sum = torch.zeros((), device=x.device)
    # The weights are the same for every micro-batch: their quantized operands are made once.
    with weight_operands_once():
        for i in range(accum):
            if seeds is not None:
                torch.default_generator.manual_seed(seeds[i])
            rows = slice(i * micro, (i + 1) * micro)
            # DDP all-reduces gradients on the last micro-batch only.
            sync = model.no_sync() if ddp and i < accum - 1 else nullcontext()
            with sync:
                with autocast:
                    _, loss = model(x[rows], y[rows])
                (loss / accum).backward()
            loss_sum += loss.detach().float()
    return loss_sum / accum


def clip_gradients(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip to a global norm of max_norm (0: no clipping); returns the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                          max_norm if max_norm > 0 else math.inf)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor


def switch_precision(run: Run, step: int) -> None:
    """From step `step` on, every quantized module computes in BF16 (high_precision_tail)."""
    run.switched = True
    run.val_loss_high_precision = None  # the switch step's, not the final weights'
    n = to_high_precision(run.gpt)
    if run.cfg.compile is not False:  # the compiled graphs quantize: trace the model anew
        torch._dynamo.reset()
        run.step_model = compile_for_training(run.model, run.cfg.compile)
    run.say(f"after step {step}: precision switch: {n} quantized modules compute in BF16 from "
            f"step {step + 1} on (high_precision_tail {run.cfg.high_precision_tail})")
    if run.flips is not None:
        run.say("weight_flips: no NVFP4 weights after the switch; no longer logged")
        run.flips = None


def train_step(run: Run, step: int) -> dict[str, Any]:
    """One optimizer step (0-based `step`) on its global batch, skipped when the loss or the
    gradient norm is not finite; returns its metrics record."""
    cfg, env = run.cfg, run.env
    t0 = time.perf_counter()
    lr = lr_at(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.decay_steps)
    set_lr(run.optimizer, lr)
    x, y = run.train_data.train_batch(step, cfg.global_batch_size, cfg.seq_len, seed=cfg.seed,
                                      rank=env.rank, world_size=env.world_size,
                                      micro_batch_size=cfg.micro_batch_size)
    if env.device.type == "cuda":
        x, y = (x.pin_memory().to(env.device, non_blocking=True),
                y.pin_memory().to(env.device, non_blocking=True))
    ddp = env.distributed and cfg.distributed == "ddp"
    # Micro-batch j of the global batch (this rank's i-th: j = rank + i * world) draws its
    # stochastic rounding from a stream named by (seed, step, j): the same on any world size.
    seeds = [stream_seed(cfg.seed, step, env.rank + i * env.world_size)
             for i in range(len(x) // cfg.micro_batch_size)]
    loss = forward_backward(run.step_model, x, y, cfg.micro_batch_size, ddp, run.autocast, seeds)
    loss = distributed.all_reduce_mean(loss, env)
    grad_norm = clip_gradients(run.model, cfg.grad_clip)
    loss_value, norm_value = torch.stack((loss, grad_norm.float())).tolist()
    # Both values are the same on every rank (reduced), so every rank skips together.
    reason = ("non-finite loss" if not math.isfinite(loss_value) else
              "non-finite grad norm" if not math.isfinite(norm_value) else None)
    if reason is None:
        run.optimizer.step()
        run.nan_skips_in_a_row = 0
    else:
        run.nan_skips += 1
        run.nan_skips_in_a_row += 1
    run.optimizer.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0
    if run.flips is not None:  # outside the timed step: watching costs no tokens/s
        run.flips.observe()
    run.train_s += dt
    run.interval_s += dt
    run.interval_tokens += run.tokens_per_step
    run.loss = loss_value
    done = step + 1
    record: dict[str, Any] = {
        "step": done, "tokens": done * run.tokens_per_step, "loss": loss_value, "lr": lr,
        "grad_norm": norm_value, "tokens_per_s": run.interval_tokens / run.interval_s,
    }
    if run.switched:
        record["high_precision"] = True
    if reason is not None:
        record.update(skipped=True, reason=reason)
        run.say(f"step {done}: {reason} (loss {loss_value}, grad norm {norm_value}): optimizer "
                f"step skipped ({run.nan_skips_in_a_row} in a row, max_nan_skips "
                f"{cfg.max_nan_skips})")
    return record


def evaluate_step(run: Run, done: int, final: bool) -> dict[str, float]:
    """The validation loss after `done` steps; with `final` (the last step, the switch step)
    also with every quantizer off, for the weights a quantized forward trained."""
    run.val_loss = evaluate(run.model, run.chunks, run.env, run.autocast)
    values = {"val_loss": run.val_loss}
    msg = f"step {done}: val_loss {run.val_loss:.4f}"
    # How much of the loss is the quantized forward's at evaluation, and what the weights give
    # served in BF16. Packed weights have no master weight to compute in high precision with.
    if final and not run.switched and get_recipe(run.cfg.recipe).weight_storage == "master":
        with high_precision(run.gpt) as n:
            if n:
                run.val_loss_high_precision = evaluate(run.model, run.chunks, run.env,
                                                       run.autocast)
                values["val_loss_high_precision"] = run.val_loss_high_precision
                msg += f" ({run.val_loss_high_precision:.4f} with every quantizer off)"
    run.say(msg)
    return values


def log_step(run: Run, record: dict[str, Any]) -> None:
    """Write `record` to metrics.jsonl (with the weight-flip rates) and print it when there is
    no progress bar; starts the next tokens/s interval."""
    if run.flips is not None:
        record.update(run.flips.report())
    run.logger.log(record)
    run.interval_s, run.interval_tokens = 0.0, 0
    if run.bar.disable:
        run.say(f"step {record['step']}/{run.cfg.max_steps} | loss {record['loss']:.4f} | lr "
                f"{record['lr']:.2e} | grad norm {record['grad_norm']:.3f} | "
                f"{record['tokens_per_s']:,.0f} tok/s")


def save_run(run: Run, done: int) -> None:
    """Checkpoint the run after `done` steps, with what a resume needs beyond the state dicts."""
    cfg = run.cfg
    state = {"recipe": cfg.recipe_name, "tokens": done * run.tokens_per_step,
             "train_tokens": len(run.train_data), "nan_skips": run.nan_skips,
             "nan_skips_in_a_row": run.nan_skips_in_a_row,
             "train_s": run.prior_train_s + run.train_s, "world_size": run.env.world_size,
             "config": cfg.to_dict()}
    path = save_checkpoint(cfg.out_dir, done, run.model, run.optimizer, state, run.env,
                           cfg.keep_checkpoints)
    run.say(f"step {done}: saved {path}")


def _loop(run: Run) -> None:
    cfg = run.cfg
    for step in range(run.start_step, cfg.max_steps):
        if cfg.switch_step is not None and step >= cfg.switch_step and not run.switched:
            switch_precision(run, step)
        record = train_step(run, step)
        done = step + 1
        last, at_switch = done == cfg.max_steps, done == cfg.switch_step
        if done % cfg.eval_every == 0 or last or at_switch:
            record.update(evaluate_step(run, done, final=last or at_switch))
        if done % cfg.log_every == 0 or last or "val_loss" in record or "reason" in record:
            log_step(run, record)
        run.bar.set_postfix(loss=f"{run.loss:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                            refresh=False)
        run.bar.update(1)
        if run.nan_skips_in_a_row > cfg.max_nan_skips:
            raise NonFiniteLossError(
                f"step {done}: {record['reason']}, {run.nan_skips_in_a_row} steps in a row "
                f"(max_nan_skips {cfg.max_nan_skips}); training stopped. The last checkpoint is "
                "intact: lower lr, lengthen warmup, or try a more robust recipe (nvfp4-nvidia, "
                "lowrank)")
        if (cfg.ckpt_every and done % cfg.ckpt_every == 0) or last:
            save_run(run, done)


def _nothing_to_train(run: Run) -> dict[str, Any]:
    """The result of a resumed run whose checkpoint is at max_steps: result.json as it is, or,
    when the run stopped between its final checkpoint and result.json, that checkpoint's."""
    cfg = run.cfg
    run.say(f"nothing to train: the checkpoint is at step {run.start_step}, the run's max_steps "
            f"is {cfg.max_steps}")
    path = cfg.out_dir / "result.json"
    if path.exists():
        return json.loads(path.read_text())
    if cfg.switch_step is not None and run.start_step >= cfg.switch_step:
        run.switched = True  # as the loop left the final weights: computing in BF16
        to_high_precision(run.gpt)
    evaluate_step(run, run.start_step, final=True)
    losses = [r["loss"] for r in read_metrics(cfg.out_dir) if "loss" in r]
    run.loss = losses[-1] if losses else run.loss
    return _result(run)


def _result(run: Run) -> dict[str, Any]:
    cfg, env = run.cfg, run.env
    steps_run = cfg.max_steps - run.start_step
    # Nothing trained in this process (a finished run's missing result): the whole run's speed.
    steps_timed, seconds = (steps_run, run.train_s) if steps_run else (cfg.max_steps,
                                                                       run.prior_train_s)
    result = {
        "recipe": cfg.recipe_name, "steps": cfg.max_steps, "steps_this_run": steps_run,
        "tokens": cfg.max_steps * run.tokens_per_step, "final_loss": run.loss,
        "final_val_loss": run.val_loss,
        "final_val_loss_high_precision": run.val_loss_high_precision,
        "tokens_per_s": (steps_timed * run.tokens_per_step / seconds if seconds
                         else math.nan),
        "train_s": run.train_s, "wall_s": time.perf_counter() - run.wall_start,
        "nan_skips": run.nan_skips, "params": run.params,
        "optimizer": run.optimizer_choice.name, "switch_step": cfg.switch_step,
        "world_size": env.world_size, "device": str(env.device), "out": str(cfg.out_dir),
    }
    if env.device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(env.device) / 2**30
    if env.is_main:
        (cfg.out_dir / "result.json").write_text(json.dumps(result, indent=1))
        run.say(f"done: {steps_run} steps in {result['wall_s']:.1f} s "
                f"({result['tokens_per_s']:,.0f} tok/s), final val_loss {run.val_loss:.4f}")
    return result


def train(cfg: PretrainConfig, *, resume: bool = False, verbose: bool = False) -> dict[str, Any]:
    """Run (or with resume=True, continue) the pretraining run of `cfg`; returns a result dict:
    final_val_loss, final_val_loss_high_precision (the final weights evaluated with every
    quantizer off; None for a BF16 recipe or after a precision switch), final_loss,
    tokens_per_s, steps, tokens, wall_s, nan_skips, params, out. A resume of a finished run
    (its checkpoint at max_steps) trains nothing and returns its result.json unchanged; one past
    max_steps is a ValueError. verbose: print every module the recipe converted or kept (the
    ConversionSummary), not its one-line short form."""
    with distributed.process_group(cfg.device) as env, \
            deterministic_algorithms(cfg.deterministic):
        run = start_run(cfg, resume, env, verbose)
        if run.start_step == cfg.max_steps:
            run.logger.close()
            return _nothing_to_train(run)
        from tqdm.auto import tqdm

        run.bar = tqdm(total=cfg.max_steps, initial=run.start_step, unit="step",
                       dynamic_ncols=True, disable=not (env.is_main and sys.stderr.isatty()))
        try:
            _loop(run)
        finally:  # also on an error, so metrics.jsonl is flushed and closed
            run.bar.close()
            run.logger.close()
        return _result(run)
