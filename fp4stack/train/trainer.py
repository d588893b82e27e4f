"""The pretraining loop: GPT + recipe + AdamW on token shards, single process, DDP or FSDP2.

    from fp4stack.train import load_config, train
    result = train(load_config("configs/pretrain/tiny.yaml", recipe="nvfp4"))

Every recipe of a comparison sees the same init (seeded), the same batches (a pure function of
the step) and the same validation tokens, so their loss curves differ only by the recipe. A run
resumed from a checkpoint reproduces the uninterrupted run's losses bit for bit on CPU. A step
whose loss or gradient norm is not finite is skipped (logged with the reason); too many in a row
stop training with NonFiniteLossError.
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..analysis.weight_flips import WeightFlips
from ..convert import high_precision, quantize_model, to_high_precision
from ..data.shards import TokenShards
from ..models.gpt import GPT
from ..nn.linear import QuantLinear
from ..nn.recipe import recipe as get_recipe
from . import distributed
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import DATA_COMMANDS, PretrainConfig
from .determinism import deterministic_algorithms
from .distributed import DistEnv
from .metrics import MetricsLogger
from .optimizers import build_optimizer, set_lr
from .schedule import lr_at

# Config fields a resumed run must share with its checkpoint: anything else would make a
# different run, not a continuation. Other changes (max_steps, logging, ...) only warn.
_RESUME_MUST_MATCH = ("model", "seq_len", "global_batch_size", "seed", "recipe")
_RESUME_FREE = ("out", "data", "max_steps", "log_every", "eval_every", "ckpt_every",
                "keep_checkpoints", "tensorboard", "device", "distributed", "max_nan_skips",
                "weight_flips")


class NonFiniteLossError(RuntimeError):
    """Training stopped: too many consecutive steps had a non-finite loss or gradient norm."""


# ------------------------------------------------------------------------------------ setup


def open_data(cfg: PretrainConfig) -> tuple[TokenShards, TokenShards]:
    """(train, val) shards of cfg.data, or a FileNotFoundError saying how to build them."""
    data = Path(cfg.data)
    if not (data / "manifest.json").exists():
        hint = DATA_COMMANDS.get(data.as_posix(), f"fp4stack data build ... --out {data}")
        raise FileNotFoundError(f"data directory {data} not found (or has no manifest.json): "
                                f"build it first with\n  {hint}\nor pass --data DIR")
    return TokenShards(data, "train"), TokenShards(data, "val")


def build_model(cfg: PretrainConfig, vocab_size: int, device: torch.device):
    """GPT of cfg.model, seeded with cfg.seed, converted in place to cfg.recipe."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model_config(vocab_size)).to(device)
    summary = quantize_model(model, cfg.recipe)
    return model, summary


def val_chunks(val: TokenShards, cfg: PretrainConfig, env: DistEnv) -> list[torch.Tensor]:
    """This rank's share of the fixed validation windows, as [rows, seq_len + 1] chunks.

    The windows are eval_batches * micro_batch_size sequences from the start of the split,
    whatever the world size (trimmed to a multiple of it, so every rank runs the same number of
    forwards, as FSDP2 requires); rank r takes rows r::world of each chunk.
    """
    rows = torch.cat([torch.cat((x, y[:, -1:]), dim=1)
                      for x, y in val.val_batches(cfg.micro_batch_size, cfg.seq_len,
                                                  cfg.eval_batches)])
    n = len(rows) - len(rows) % env.world_size
    if n == 0:
        raise ValueError(f"validation split has {len(rows)} windows of seq_len {cfg.seq_len}, "
                         f"fewer than the {env.world_size} ranks")
    per = cfg.micro_batch_size * env.world_size
    return [rows[i:i + per][env.rank::env.world_size] for i in range(0, n, per)]


@torch.no_grad()
def evaluate(model: nn.Module, chunks: list[torch.Tensor], env: DistEnv, autocast) -> float:
    """Mean next-token cross-entropy (no MoE aux loss) over all ranks' validation windows."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=env.device)
    # Evaluation must not move the RNG streams training draws from (stochastic rounding).
    with torch.random.fork_rng(devices=[env.device] if env.device.type == "cuda" else []):
        for w in chunks:
            w = w.to(env.device)
            with autocast:
                logits, _ = model(w[:, :-1])
            ce = F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(),
                                 reduction="sum")
            total[0] += ce.double()
            total[1] += w[:, 1:].numel()
    model.train()
    total = distributed.all_reduce_sum(total, env)
    return (total[0] / total[1]).item()


def lowrank_counters(model: nn.Module) -> dict[str, int]:
    """Forward counters of the QuantLinears (they time the low-rank branch's refreshes)."""
    return {n: m._steps for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def set_lowrank_counters(model: nn.Module, counters: dict[str, int]) -> None:
    for n, m in model.named_modules():
        if isinstance(m, QuantLinear) and n in counters:
            m._steps = counters[n]


def forward_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro: int,
                     ddp: bool, autocast) -> torch.Tensor:
    """Accumulate the gradients of this rank's rows of one global batch, `micro` rows per
    forward; returns their mean loss (detached)."""
    accum = len(x) // micro
    loss_sum = torch.zeros((), device=x.device)
    for i in range(accum):
        rows = slice(i * micro, (i + 1) * micro)
        # DDP all-reduces gradients on the last micro-batch only.
        sync = model.no_sync() if ddp and i < accum - 1 else nullcontext()
        with sync:
            with autocast:
                _, loss = model(x[rows], y[rows])
            (loss / accum).backward()
        loss_sum += loss.detach().float()
    return loss_sum / accum


def optimizer_of(cfg: PretrainConfig) -> str:
    """The optimizer a run uses: the config's, its NVFP4-state form when the recipe asks."""
    if get_recipe(cfg.recipe).optimizer_states == "nvfp4" and not cfg.optimizer.endswith("4"):
        return cfg.optimizer + "4"
    return cfg.optimizer


def clip_gradients(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip to a global norm of max_norm (0: no clipping); returns the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                          max_norm if max_norm > 0 else math.inf)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor


def _check_resume(saved: dict[str, Any], cfg: PretrainConfig, say) -> None:
    current = cfg.to_dict()
    for key in _RESUME_MUST_MATCH:
        if saved.get(key) != current[key]:
            raise ValueError(f"--resume: {key} is {current[key]!r} but the checkpoint was trained "
                             f"with {saved.get(key)!r}; resume with the same {key}, or start a "
                             "new run with another --out")
    changed = [k for k in current if k not in _RESUME_MUST_MATCH + _RESUME_FREE
               and saved.get(k, current[k]) != current[k]]
    if changed:
        say("warning: resuming with changed " + ", ".join(
            f"{k} ({saved[k]!r} -> {current[k]!r})" for k in changed))
    decay = saved.get("lr_decay_steps") or saved.get("max_steps")
    if decay != cfg.decay_steps:
        say(f"warning: the cosine now ends at step {cfg.decay_steps}, not {decay}: the resumed "
            "run's learning rates differ from the original run's")


def _print(env: DistEnv, bar, msg: str) -> None:
    if not env.is_main:
        return
    if bar is not None and not bar.disable:
        bar.write(msg)
    else:
        print(msg, flush=True)


# ------------------------------------------------------------------------------------ train


def train(cfg: PretrainConfig, *, resume: bool = False) -> dict[str, Any]:
    """Run (or with resume=True, continue) the pretraining run of `cfg`; returns a result dict:
    final_val_loss, final_val_loss_high_precision (the final weights evaluated with every
    quantizer off; None for a BF16 recipe or after a precision switch), final_loss,
    tokens_per_s, steps, tokens, wall_s, nan_skips, params, out."""
    env = distributed.setup(cfg.device)
    try:
        with deterministic_algorithms(cfg.deterministic):
            return _train(cfg, resume, env)
    finally:
        distributed.teardown(env)


def _train(cfg: PretrainConfig, resume: bool, env: DistEnv) -> dict[str, Any]:
    wall_start = time.perf_counter()
    out = cfg.out_dir
    device = env.device
    say = lambda msg: _print(env, None, msg)  # noqa: E731 (replaced by the bar's once it exists)

    # ---- shapes and data
    per_rank = cfg.micro_batch_size * env.world_size
    if cfg.global_batch_size % per_rank:
        raise ValueError(f"global_batch_size {cfg.global_batch_size} must be a multiple of "
                         f"micro_batch_size {cfg.micro_batch_size} x world size "
                         f"{env.world_size} = {per_rank}: lower --micro-batch-size (to a "
                         f"divisor of {cfg.global_batch_size // env.world_size})")
    accum = cfg.global_batch_size // per_rank
    tokens_per_step = cfg.global_batch_size * cfg.seq_len
    train_data, val_data = open_data(cfg)
    chunks = val_chunks(val_data, cfg, env)

    ckpt = latest_checkpoint(out)
    if resume and ckpt is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {out / 'checkpoints'}")
    if not resume and ckpt is not None:
        raise FileExistsError(f"{out} already holds a checkpoint ({ckpt.name}): pass --resume to "
                              "continue that run, or --out another directory")
    if resume:  # before building anything: a mismatch must not surface as a state-dict error
        saved = json.loads((ckpt / "state.json").read_text())
        _check_resume(saved["config"], cfg, say)
        if saved["train_tokens"] != len(train_data):
            raise ValueError(f"--resume: the checkpoint was trained on {saved['train_tokens']} "
                             f"training tokens, {cfg.data} holds {len(train_data)}")

    # ---- model, optimizer
    model, summary = build_model(cfg, train_data.vocab_size, device)
    gpt = model
    if env.is_main:
        print(summary, flush=True)
    if env.distributed and cfg.distributed == "fsdp2" and (
            cfg.optimizer != "adamw" or get_recipe(cfg.recipe).optimizer_states != "fp32"):
        raise ValueError(f"optimizer {cfg.optimizer!r} is not supported under FSDP2 (its NVFP4 "
                         "states are not sharded); use --distributed ddp or optimizer adamw")
    if cfg.weight_flips and env.distributed and cfg.distributed == "fsdp2":
        raise ValueError("weight_flips needs whole weights on each rank: use --distributed ddp "
                         "or set weight_flips: false")
    flips = WeightFlips(gpt) if cfg.weight_flips and env.is_main else None  # main logs
    model = distributed.wrap(model, cfg.distributed, env)
    optimizer_name = optimizer_of(cfg)
    optimizer = build_optimizer(model, optimizer_name, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                weight_decay=cfg.weight_decay, muon_lr=cfg.muon_lr,
                                seed=cfg.seed, fused=device.type == "cuda")
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else nullcontext())

    start_step, skips_total, skips_row, prior_train_s = 0, 0, 0, 0.0
    if resume:
        state = load_checkpoint(ckpt, model, optimizer, env)
        start_step = state["step"]
        skips_total, skips_row = state["nan_skips"], state["nan_skips_in_a_row"]
        prior_train_s = state["train_s"]
        set_lowrank_counters(gpt, state["lowrank_counters"])
        say(f"resumed from {ckpt} at step {start_step}")
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    logger = MetricsLogger(out, env.is_main, cfg.tensorboard,
                           resume_step=start_step if resume else None)

    n_params = gpt.num_params()
    say(f"pretrain: {n_params / 1e6:.2f}M parameters"
        + (f" ({gpt.num_params(active=True) / 1e6:.2f}M active)" if gpt.config.moe else "")
        + f", recipe {cfg.recipe_name}, optimizer {optimizer_name}, {env.world_size} x {device}"
        + (f" ({cfg.distributed})" if env.distributed else "")
        + f", {cfg.global_batch_size} x {cfg.seq_len} = {tokens_per_step} tokens/step "
        f"(micro {cfg.micro_batch_size} x {accum} accumulation), steps {start_step} -> "
        f"{cfg.max_steps}, out {out}")

    # ---- loop
    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.max_steps, initial=start_step, unit="step", dynamic_ncols=True,
               disable=not (env.is_main and sys.stderr.isatty()))
    say = lambda msg: _print(env, bar, msg)  # noqa: E731
    ddp = env.distributed and cfg.distributed == "ddp"
    train_s, interval_s, interval_tokens = 0.0, 0.0, 0
    loss_value = val_loss = math.nan
    val_loss_hp = None  # the final weights' val loss with every quantizer off
    # Packed weights have no master weight to compute in high precision with (config refuses
    # a tail for them; the final evaluation skips them).
    can_switch = get_recipe(cfg.recipe).weight_storage == "master"
    switched = False
    try:
        for step in range(start_step, cfg.max_steps):
            if cfg.switch_step is not None and step >= cfg.switch_step and not switched:
                switched = True
                val_loss_hp = None  # the switch step's, not the final weights'
                n = to_high_precision(gpt)
                say(f"after step {step}: precision switch: {n} quantized modules compute in BF16 "
                    f"from step {step + 1} on (high_precision_tail {cfg.high_precision_tail})")
                if flips is not None:
                    say("weight_flips: no NVFP4 weights after the switch; no longer logged")
                    flips = None
            t0 = time.perf_counter()
            lr = lr_at(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.decay_steps)
            set_lr(optimizer, lr)
            x, y = train_data.train_batch(step, cfg.global_batch_size, cfg.seq_len, seed=cfg.seed,
                                          rank=env.rank, world_size=env.world_size)
            if device.type == "cuda":
                x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(
                    device, non_blocking=True)
            loss = forward_backward(model, x, y, cfg.micro_batch_size, ddp, autocast)
            loss = distributed.all_reduce_mean(loss, env)
            grad_norm = clip_gradients(model, cfg.grad_clip)
            loss_value, norm_value = torch.stack((loss, grad_norm.float())).tolist()
            # Both values are the same on every rank (reduced), so every rank skips together.
            reason = ("non-finite loss" if not math.isfinite(loss_value) else
                      "non-finite grad norm" if not math.isfinite(norm_value) else None)
            if reason is None:
                optimizer.step()
                skips_row = 0
            else:
                skips_total += 1
                skips_row += 1
            optimizer.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            if flips is not None:  # outside the timed step: watching costs no tokens/s
                flips.observe()
            train_s += dt
            interval_s += dt
            interval_tokens += tokens_per_step
            done = step + 1

            record: dict[str, Any] = {
                "step": done, "tokens": done * tokens_per_step, "loss": loss_value, "lr": lr,
                "grad_norm": norm_value, "tokens_per_s": interval_tokens / interval_s,
            }
            if switched:
                record["high_precision"] = True
            if reason is not None:
                record.update(skipped=True, reason=reason)
                say(f"step {done}: {reason} (loss {loss_value}, grad norm {norm_value}): optimizer "
                    f"step skipped ({skips_row} in a row, max_nan_skips {cfg.max_nan_skips})")
            last = done == cfg.max_steps
            at_switch = done == cfg.switch_step
            if done % cfg.eval_every == 0 or last or at_switch:
                val_loss = evaluate(model, chunks, env, autocast)
                record["val_loss"] = val_loss
                msg = f"step {done}: val_loss {val_loss:.4f}"
                # The same weights with every quantizer off: how much of the loss is the
                # quantized forward's at evaluation, and what the weights give served in BF16.
                if (last or at_switch) and not switched and can_switch:
                    with high_precision(gpt) as n:
                        if n:
                            val_loss_hp = evaluate(model, chunks, env, autocast)
                            record["val_loss_high_precision"] = val_loss_hp
                            msg += f" ({val_loss_hp:.4f} with every quantizer off)"
                say(msg)
            if done % cfg.log_every == 0 or last or "val_loss" in record or reason is not None:
                if flips is not None:
                    record.update(flips.report())
                logger.log(record)
                interval_s, interval_tokens = 0.0, 0
                if bar.disable:
                    say(f"step {done}/{cfg.max_steps} | loss {loss_value:.4f} | lr {lr:.2e} | "
                        f"grad norm {norm_value:.3f} | {record['tokens_per_s']:,.0f} tok/s")
            bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                            refresh=False)
            bar.update(1)
            if skips_row > cfg.max_nan_skips:
                raise NonFiniteLossError(
                    f"step {done}: {reason}, {skips_row} steps in a row (max_nan_skips "
                    f"{cfg.max_nan_skips}); training stopped. The last checkpoint is intact: lower "
                    "lr, lengthen warmup, or try a more robust recipe (nvfp4-nvidia, lowrank)")
            if (cfg.ckpt_every and done % cfg.ckpt_every == 0) or last:
                state = {"recipe": cfg.recipe_name, "tokens": done * tokens_per_step,
                         "train_tokens": len(train_data), "nan_skips": skips_total,
                         "nan_skips_in_a_row": skips_row, "train_s": prior_train_s + train_s,
                         "lowrank_counters": lowrank_counters(gpt), "world_size": env.world_size,
                         "config": cfg.to_dict()}  # what a resume needs beyond the state dicts
                path = save_checkpoint(out, done, model, optimizer, state, env,
                                       cfg.keep_checkpoints)
                say(f"step {done}: saved {path}")
    finally:  # also on an error, so metrics.jsonl is flushed and closed
        bar.close()
        logger.close()

    steps_run = cfg.max_steps - start_step
    result = {
        "recipe": cfg.recipe_name, "steps": cfg.max_steps, "steps_this_run": steps_run,
        "tokens": cfg.max_steps * tokens_per_step, "final_loss": loss_value,
        "final_val_loss": val_loss,
        "final_val_loss_high_precision": val_loss_hp,
        "tokens_per_s": steps_run * tokens_per_step / train_s if train_s else math.nan,
        "train_s": train_s, "wall_s": time.perf_counter() - wall_start,
        "nan_skips": skips_total, "params": n_params, "optimizer": optimizer_name,
        "switch_step": cfg.switch_step,
        "world_size": env.world_size,
        "device": str(device), "out": str(out),
    }
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if env.is_main:
        (out / "result.json").write_text(json.dumps(result, indent=1))
        say(f"done: {steps_run} steps in {result['wall_s']:.1f} s "
            f"({result['tokens_per_s']:,.0f} tok/s), final val_loss {val_loss:.4f}")
    return result
