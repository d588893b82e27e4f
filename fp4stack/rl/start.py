"""A GRPO run's start: the SFT-warmed policy (cached, so every arm of a comparison starts from
the same weights), the rollout engine, and the parts the loop trains with (`build_run`); in an
engine process (`engine_device: process`) the engine it serves instead (`serve_engine`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..convert import quantize_model
from ..data.tasks import Task, load_task
from ..device import resolve_device
from ..nn.recipe import Recipe
from ..nn.recipe import four_over_six as with_four_over_six
from ..nn.recipe import recipe as get_recipe
from ..train.determinism import deterministic_algorithms
from ..train.run import compile_for_training
from . import policy as lm
from .config import ENGINE_PROCESS, RLConfig
from .fast_rollout import FastRolloutEngine, build_engine
from .policies import build_policy, calibration_sequences, sft_warmup
from .remote import TRAINER_RANK, RemoteEngine, serve
from .rollout import RolloutEngine

SFT_FILE = "sft_policy.pt"
# The RLConfig fields that determine the SFT warm-up's weights.
SFT_KEYS = ("policy", "upcycle", "task", "task_options", "seed", "sft_steps", "sft_lr",
            "sft_batch_size", "sft_recipe", "max_new_tokens")


def sft_inputs(cfg: RLConfig, vocab_size: int | None) -> dict[str, Any]:
    """Everything that determines the SFT warm-up's weights: its cache is reused only when these
    match (a comparison's runs differ in rollout and trainer only, so they share it)."""
    inputs = {k: getattr(cfg, k) for k in SFT_KEYS} | {"vocab_size": vocab_size}
    return json.loads(json.dumps(inputs, sort_keys=True, default=str))  # as stored: plain JSON


def _load_sft(cached: Path, inputs: dict[str, Any], device: torch.device
              ) -> tuple[dict[str, torch.Tensor] | None, str]:
    """The cached warm-up's weights when it was made from `inputs`, else (None, why not)."""
    stored = torch.load(cached, map_location=device, weights_only=True)
    if not (isinstance(stored, dict) and isinstance(stored.get("inputs"), str)):
        return None, "it records no inputs"
    made = json.loads(stored["inputs"])
    diff = [f"{k}: {made.get(k)!r} -> {inputs.get(k)!r}"
            for k in sorted(set(made) | set(inputs)) if made.get(k) != inputs.get(k)]
    return (None, "; ".join(diff)) if diff else (stored["state_dict"], "")


def prepare_policy(cfg: RLConfig, task: Task, device: torch.device, cache_dir: Path | None,
                   log=print) -> tuple[nn.Module, lm.TokenizerLike]:
    """The starting policy: built, upcycled, SFT-warmed (cached in cache_dir/sft_policy.pt with
    the inputs that made it, so every run of a comparison starts from the same weights and a run
    with other inputs redoes the warm-up)."""
    max_len = 64 + cfg.max_new_tokens
    model, tokenizer = build_policy(cfg.policy, cfg.upcycle, cfg.seed, max_len)
    model.to(device)
    if not cfg.sft_steps:
        return model.eval(), tokenizer
    inputs = sft_inputs(cfg, getattr(tokenizer, "vocab_size", None))
    cached = cache_dir / SFT_FILE if cache_dir is not None else None
    if cached is not None and cached.exists():
        weights, why = _load_sft(cached, inputs, device)
        if weights is not None:
            model.load_state_dict(weights)
            log(f"policy: loaded the SFT warm-up from {cached}")
            return model.eval(), tokenizer
        log(f"policy: {cached} does not match this run's SFT inputs ({why}); redoing the warm-up")
    # Deterministic algorithms, so that arms trained apart (in other processes, on other days)
    # start from the same weights: the start's digest in each result.json says whether they did.
    with deterministic_algorithms(warn_only=True):
        sft_warmup(model, tokenizer, task, steps=cfg.sft_steps, batch_size=cfg.sft_batch_size,
                   lr=cfg.sft_lr, seed=cfg.seed, device=device, recipe=cfg.sft_recipe, log=log)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f".{cached.name}.tmp")  # fixed: a killed save's is overwritten
        torch.save({"inputs": json.dumps(inputs), "state_dict": model.state_dict()}, tmp)
        os.replace(tmp, cached)
    return model.eval(), tokenizer


def warm_up_policy(cfg: RLConfig, cache_dir: str | os.PathLike) -> None:
    """Make the SFT start of `cfg` in cache_dir (or find it there), as `run_rl` would before its
    first step: runs started side by side then all load it."""
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)  # the state run_rl starts its warm-up from
    task = load_task(cfg.task, **cfg.task_options)
    prepare_policy(cfg, task, device, Path(cache_dir))


@dataclass
class RunParts:
    """What a GRPO run trains with: the task, the policy (the trainer's model) and its
    tokenizer, the rollout engine on its device, the optimizer, and the KL reference (or None)."""

    task: Task
    model: nn.Module
    tokenizer: lm.TokenizerLike
    engine: RolloutEngine | RemoteEngine
    engine_device: torch.device | str
    opt: torch.optim.Optimizer
    ref: nn.Module | None
    step_model: nn.Module | None = None  # what the update's forwards call: model, or compiled


def engine_kind(engine: RolloutEngine | RemoteEngine) -> str:
    """"fast" or "reference"; an engine process's as it reported it."""
    if isinstance(engine, RemoteEngine):
        return engine.kind
    return "fast" if isinstance(engine, FastRolloutEngine) else "reference"


def run_recipe(name: str, cfg: RLConfig) -> Recipe:
    """Recipe `name` with the run's block scales: Four Over Six when cfg.four_over_six, as the
    engine's (RolloutEngine applies the same), so trainer, engine and the per-layer error
    analysis quantize alike."""
    r = get_recipe(name)
    return with_four_over_six(r) if cfg.four_over_six else r


def trainer_recipe(cfg: RLConfig) -> Recipe:
    """The trainer's recipe: cfg.trainer's with the run's block scales (`run_recipe`)."""
    return run_recipe(cfg.trainer, cfg)


def make_engine(cfg: RLConfig, base: nn.Module, tokenizer: lm.TokenizerLike,
                device: torch.device) -> RolloutEngine:
    """cfg's rollout engine on `device` (BF16 on CUDA), built from the unconverted `base`."""
    dtype = torch.bfloat16 if device.type == "cuda" else None
    return build_engine(cfg.engine, base, tokenizer, cfg.rollout, record=cfg.routing_replay,
                        temperature=cfg.temperature, top_p=cfg.top_p,
                        max_new_tokens=cfg.max_new_tokens, logprobs=cfg.logprobs,
                        compensation=cfg.compensation, compensation_mode=cfg.compensation_mode,
                        four_over_six=cfg.four_over_six, dtype=dtype, device=device)


def build_run(cfg: RLConfig, device: torch.device, cache_dir: Path | None, log=print
              ) -> RunParts:
    """cfg's task, SFT-warmed policy (cached in cache_dir), rollout engine (BF16 on CUDA; with
    engine_device "process" the handle on the engine process), trainer recipe, AdamW and KL
    reference, as `run_rl` starts from; the engine not yet refitted (`start_engine`)."""
    torch.manual_seed(cfg.seed)
    task = load_task(cfg.task, **cfg.task_options)
    base, tokenizer = prepare_policy(cfg, task, device, cache_dir, log)
    if cfg.engine_device == ENGINE_PROCESS:
        engine = RemoteEngine(tokenizer, device, temperature=cfg.temperature)
        engine_device = engine.device
    else:
        engine_device = (device if cfg.engine_device == "same"
                         else resolve_device(cfg.engine_device))
        engine = make_engine(cfg, base, tokenizer, engine_device)
    ref = None
    if cfg.kl_coef > 0:
        import copy

        ref = copy.deepcopy(base).eval().requires_grad_(False)
    model = base.train()
    if cfg.trainer != "bf16":
        quantize_model(model, trainer_recipe(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return RunParts(task, model, tokenizer, engine, engine_device, opt, ref,
                    compile_for_training(model, cfg.compile))


def serve_engine(cfg: RLConfig, device: torch.device, log=print) -> int:
    """The engine process of `engine_device: process` (rank 1): builds the policy's architecture
    (its weights come with the first refit), cfg's engine on `device`, and serves the trainer
    until it stops; returns the requests served."""
    torch.manual_seed(cfg.seed)
    base, tokenizer = build_policy(cfg.policy, cfg.upcycle, cfg.seed, 64 + cfg.max_new_tokens)
    engine = make_engine(cfg, base.to(device).eval(), tokenizer, device)
    del base
    kind = engine_kind(engine)
    log(f"rl engine: {kind} {cfg.rollout} on {device}, serving the trainer (rank {TRAINER_RANK})")
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    return serve(engine, generator, kind)


def start_engine(cfg: RLConfig, parts: RunParts, log=print) -> None:
    """Refit the engine from the trainer's weights; with static compensation, fix its channels
    from calibration_size task examples."""
    engine = parts.engine
    engine.sync(parts.model)
    if (cfg.compensation_mode == "static" and engine.recipe is not None
            and engine.recipe.compensation is not None):
        n = engine.calibrate(calibration_sequences(parts.task, parts.tokenizer,
                                                   cfg.calibration_size, cfg.seed))
        log(f"rl: compensation channels fixed from {n} task examples (static mode)")


START_K3_HINT = 1.0  # k3 of the first step above which the start itself is the problem


def start_hint(cfg: RLConfig, first: dict[str, Any]) -> str | None:
    """A line for the log when the first step's k3 (`first`, its metrics) says the rollout
    engine's policy is another one than the trainer's from the start, as a small policy's
    NVFP4 copy of a BF16 warm-up can be (docs/results/rl.md); None otherwise."""
    if not first.get("k3", 0.0) > START_K3_HINT or cfg.sft_recipe != "bf16" or not cfg.sft_steps:
        return None
    return (f"the {cfg.rollout} engine's policy is far from the trainer's from the first step "
            f"(k3 {first['k3']:.3g}, per-token |dlogp| {first.get('logp_diff_mean', math.nan):.2f}"
            f" on average): this model may be too sensitive to {cfg.rollout} to start from a "
            "BF16 warm-up; a quantization-aware one (sft_recipe: nvfp4@forward or qat-w) "
            "starts the engine closer")
