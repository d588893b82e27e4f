"""A pretraining run in progress (`Run`) and how one starts: data, model, optimizer, logger.

`start_run` checks a resume against its checkpoint before building anything, builds the seeded
GPT of the config converted to its recipe, wraps it for DDP / FSDP2, builds the optimizer the
config and recipe name, restores the checkpoint's state, and opens the run's logs.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..analysis.weight_flips import WeightFlips
from ..convert import quantize_model
from ..data.shards import TokenShards
from ..files import make_output_dir
from ..models.gpt import GPT
from . import distributed
from .checkpoint import load_checkpoint
from .config import DATA_COMMANDS, PretrainConfig
from .distributed import DistEnv
from .evaluation import val_chunks
from .metrics import MetricsLogger
from .optimizers import OptimizerChoice, build_from_config, optimizer_of
from .resume import checkpoint_to_resume


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


def _say(env: DistEnv, bar: Any, msg: str) -> None:
    # Main rank only; through the progress bar while it shows, so that the bar stays whole.
    if not env.is_main:
        return
    if bar is not None and not bar.disable:
        bar.write(msg)
    else:
        print(msg, flush=True)


@dataclass
class Run:
    """A pretraining run in progress: what it trains, and the counters its steps move."""

    cfg: PretrainConfig
    env: DistEnv
    model: nn.Module  # wrapped for DDP / sharded by FSDP2
    gpt: GPT  # the model itself
    optimizer: torch.optim.Optimizer
    optimizer_choice: OptimizerChoice
    train_data: TokenShards
    chunks: list[torch.Tensor]  # this rank's validation windows
    autocast: Any
    logger: MetricsLogger
    flips: WeightFlips | None  # main rank only
    wall_start: float
    params: int
    start_step: int = 0
    bar: Any = None  # the progress bar, while the loop runs
    step_model: nn.Module | None = None  # what train steps call: `model`, or it compiled
    nan_skips: int = 0
    nan_skips_in_a_row: int = 0
    prior_train_s: float = 0.0  # training time of the runs this one continues
    train_s: float = 0.0
    interval_s: float = 0.0  # training time and tokens since the last logged record
    interval_tokens: int = 0
    loss: float = math.nan
    val_loss: float = math.nan
    val_loss_high_precision: float | None = None  # the final weights', every quantizer off
    switched: bool = False  # the precision switch happened

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.global_batch_size * self.cfg.seq_len

    def say(self, msg: str) -> None:
        _say(self.env, self.bar, msg)


def start_run(cfg: PretrainConfig, resume: bool, env: DistEnv, verbose: bool = False) -> Run:
    """Data, model, optimizer and logger of cfg's run; with resume, restored from its last
    checkpoint. verbose: print the whole ConversionSummary, not its one-line short form."""
    wall_start = time.perf_counter()
    out, device = cfg.out_dir, env.device
    per_rank = cfg.micro_batch_size * env.world_size
    if cfg.global_batch_size % per_rank:
        raise ValueError(f"global_batch_size {cfg.global_batch_size} must be a multiple of "
                         f"micro_batch_size {cfg.micro_batch_size} x world size "
                         f"{env.world_size} = {per_rank}: lower --micro-batch-size (to a "
                         f"divisor of {cfg.global_batch_size // env.world_size})")
    train_data, val_data = open_data(cfg)
    chunks = val_chunks(val_data, cfg, env)
    ckpt = checkpoint_to_resume(cfg, resume, len(train_data), lambda m: _say(env, None, m))

    gpt, summary = build_model(cfg, train_data.vocab_size, device)
    if env.is_main:
        print(summary if verbose else summary.short(), flush=True)
    choice = optimizer_of(cfg)
    fsdp2 = env.distributed and cfg.distributed == "fsdp2"
    if cfg.weight_flips and fsdp2:
        raise ValueError("weight_flips needs whole weights on each rank: use --distributed ddp "
                         "or set weight_flips: false")
    flips = WeightFlips(gpt) if cfg.weight_flips and env.is_main else None  # main logs
    model = distributed.wrap(gpt, cfg.distributed, env, gather=cfg.fsdp_gather)
    optimizer = build_from_config(model, cfg, fused=device.type == "cuda", shard_local=fsdp2,
                                  rank=env.rank, world_size=env.world_size)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else nullcontext())
    state = load_checkpoint(ckpt, model, optimizer, env) if ckpt is not None else {}
    if ckpt is not None:
        _say(env, None, f"resumed from {ckpt} at step {state['step']}")
    if env.is_main:
        make_output_dir(out)
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    logger = MetricsLogger(out, env.is_main, cfg.tensorboard,
                           resume_step=state["step"] if ckpt is not None else None)
    run = Run(cfg, env, model, gpt, optimizer, choice, train_data, chunks, autocast, logger,
              flips, wall_start, gpt.num_params(), start_step=state.get("step", 0),
              nan_skips=state.get("nan_skips", 0),
              nan_skips_in_a_row=state.get("nan_skips_in_a_row", 0),
              prior_train_s=state.get("train_s", 0.0),
              step_model=compile_for_training(model, cfg.compile))
    run.say(f"pretrain: {run.params / 1e6:.2f}M parameters"
            + (f" ({gpt.num_params(active=True) / 1e6:.2f}M active)" if gpt.config.moe else "")
            + f", recipe {cfg.recipe_name}, optimizer {choice.name}, {env.world_size} x {device}"
            + ("" if cfg.compile is False else
               f", torch.compile{'' if cfg.compile is True else f' ({cfg.compile})'}")
            + (f" ({cfg.distributed})" if env.distributed else "")
            + f", {cfg.global_batch_size} x {cfg.seq_len} = {run.tokens_per_step} tokens/step "
            f"(micro {cfg.micro_batch_size} x {cfg.global_batch_size // per_rank} accumulation), "
            f"steps {run.start_step} -> {cfg.max_steps}, out {out}")
    return run


def compile_for_training(model: nn.Module, compile: bool | str) -> nn.Module:
    """`model` through torch.compile (`compile`: True, or a torch.compile mode) for the training
    steps' forwards and backwards; `model` itself when compile is False. The compiled wrapper
    shares the model's parameters; checkpoints and evaluation keep using the model (its state
    dict keys stay the same)."""
    if compile is False:
        return model
    return torch.compile(model, mode=None if compile is True else compile)
