"""The pretraining optimizers: AdamW, Muon or ROOT, with fp32 or NVFP4 states.

The config's `optimizer` names the algorithm (adamw, muon, root), the recipe's
`optimizer_states` the format of its states (fp32, nvfp4); `optimizer_of` resolves the two, and
`TABLE` maps the pair to the name a run reports and the optimizer it builds:

    adamw, fp32    adamw    torch.optim.AdamW
    adamw, nvfp4   adamw4   fp4stack.optim.AdamW4 (both moments NVFP4)
    muon,  fp32    muon     fp4stack.optim.Muon4(quantize=False): torch's Muon + AdamW
    muon,  nvfp4   muon4    fp4stack.optim.Muon4 (NVFP4 Newton-Schulz operands and momentum)
    root,  fp32    root     fp4stack.optim.ROOT: Muon with ROOT's shape-adaptive Newton-Schulz
                            coefficients and outlier soft-threshold, torch's AdamW
    root,  nvfp4   root4    fp4stack.optim.ROOT4 (ROOT with Muon4's NVFP4 parts)

The config values `adamw4`, `muon4` and `root4` name AdamW, Muon and ROOT with NVFP4 states,
whatever the recipe's optimizer_states; the config's `adamw4_transform`, else the recipe's,
picks how AdamW4 (the NVFP4-state AdamW, also the non-matrix part of muon4 and root4) stores
v. Each param group carries `lr_scale`, its learning rate relative to the config's `lr`, so the
one warmup + cosine schedule drives every group (Muon's matrices run at muon_lr, the rest at
lr).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from ..nn.recipe import recipe as get_recipe
from .config import ALIASES, STATE_FORMATS, PretrainConfig, check_optimizer


def _state_format(adamw4_transform: str | None):
    """AdamW4's StateFormat with that transform, or None for its default."""
    from ..optim import StateFormat

    return None if adamw4_transform is None else StateFormat(transform=adamw4_transform)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decoupled weight decay on matrices only. Norm gains, biases and embeddings
    are not decayed (shrinking a gain or a token's embedding toward 0 is not regularisation)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        skip = p.ndim < 2 or "embed" in name or "norm" in name
        (no_decay if skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def _adamw(model: nn.Module, groups: list[dict[str, Any]], *, lr: float,
           betas: tuple[float, float], eps: float, fused: bool, **_: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)


def _adamw4(model: nn.Module, groups: list[dict[str, Any]], *, lr: float,
            betas: tuple[float, float], eps: float, seed: int,
            adamw4_transform: str | None = None, **_: Any) -> torch.optim.Optimizer:
    from ..optim import AdamW4

    fmt = _state_format(adamw4_transform)
    return AdamW4(groups, lr=lr, betas=betas, eps=eps, seed=seed,
                  **({} if fmt is None else {"state_format": fmt}))


def _muon(model: nn.Module, groups: list[dict[str, Any]], *, quantize: bool, lr: float,
          betas: tuple[float, float], eps: float, weight_decay: float, muon_lr: float, seed: int,
          root: bool = False, adamw4_transform: str | None = None,
          **_: Any) -> torch.optim.Optimizer:
    from ..optim.muon4 import Muon4
    from ..optim.muon_params import split_params
    from ..optim.root import ROOT

    matrices, _ = split_params(model)
    ids = {id(p) for p in matrices}
    rest = [{**g, "params": [p for p in g["params"] if id(p) not in ids]} for g in groups]
    opt = (ROOT if root else Muon4)(
        [{"params": [p for p in matrices if p.requires_grad]}], lr=muon_lr,
        weight_decay=weight_decay, quantize=quantize,
        adamw_params=[g for g in rest if g["params"]], adamw_lr=lr, adamw_betas=betas,
        adamw_eps=eps, seed=seed, adamw_state_format=_state_format(adamw4_transform))
    for group in opt.param_groups:
        group["lr_scale"] = muon_lr / lr if group.get("use_muon") else 1.0
    return opt


# (optimizer, optimizer_states) -> (the name a run reports, builder)
TABLE: dict[tuple[str, str], tuple[str, Callable[..., torch.optim.Optimizer]]] = {
    ("adamw", "fp32"): ("adamw", _adamw),
    ("adamw", "nvfp4"): ("adamw4", _adamw4),
    ("muon", "fp32"): ("muon", partial(_muon, quantize=False)),
    ("muon", "nvfp4"): ("muon4", partial(_muon, quantize=True)),
    ("root", "fp32"): ("root", partial(_muon, quantize=False, root=True)),
    ("root", "nvfp4"): ("root4", partial(_muon, quantize=True, root=True)),
}


@dataclass(frozen=True)
class OptimizerChoice:
    """An optimizer algorithm (one of OPTIMIZERS) and the format of its states (STATE_FORMATS)."""

    optimizer: str
    states: str

    @property
    def name(self) -> str:
        """The name runs report (logs, result.json): adamw, adamw4, muon, muon4, root or
        root4."""
        return TABLE[(self.optimizer, self.states)][0]


def resolve_optimizer(optimizer: str, states: str) -> OptimizerChoice:
    """The optimizer of a config's `optimizer` value and its recipe's `optimizer_states`."""
    check_optimizer(optimizer)
    if states not in STATE_FORMATS:
        raise ValueError(f"optimizer_states must be one of {list(STATE_FORMATS)}, got {states!r}")
    optimizer, states = ALIASES.get(optimizer, (optimizer, states))
    return OptimizerChoice(optimizer, states)


def optimizer_of(cfg: PretrainConfig) -> OptimizerChoice:
    """The optimizer a run uses: the config's, with its recipe's optimizer_states."""
    return resolve_optimizer(cfg.optimizer, get_recipe(cfg.recipe).optimizer_states)


# The optimizers that do not know FSDP2's DTensor parameters; they step each rank's rows through
# optim.shard_local. torch's AdamW and Muon4 / ROOT (which gathers each sharded matrix for its
# Newton-Schulz step) take DTensors themselves.
SHARD_LOCAL = (OptimizerChoice("adamw", "nvfp4"),)


def build_optimizer(model: nn.Module, choice: OptimizerChoice, *, lr: float,
                    betas: tuple[float, float], eps: float, weight_decay: float, muon_lr: float,
                    seed: int, fused: bool = False, adamw4_transform: str | None = None,
                    shard_local: bool = False, rank: int = 0, world_size: int = 1
                    ) -> torch.optim.Optimizer:
    """The optimizer `choice` over `model`'s trainable parameters; fused: torch's fused AdamW
    kernel (CUDA); adamw4_transform: how its AdamW4 part stores v (None: the default);
    shard_local: the model is sharded by FSDP2 (this process rank of world_size): a choice
    of SHARD_LOCAL then steps each rank's rows (optim.shard_local)."""
    _, build = TABLE[(choice.optimizer, choice.states)]
    groups = param_groups(model, weight_decay)
    options = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, muon_lr=muon_lr,
                   seed=seed, fused=fused, adamw4_transform=adamw4_transform)
    if shard_local and choice in SHARD_LOCAL:
        from ..optim.shard_local import ShardLocal

        for group in groups:
            group.update(seed=seed, lr_scale=1.0)
        return ShardLocal(groups, lambda local: build(model, local, **options), rank,
                          world_size)
    opt = build(model, groups, **options)
    for group in opt.param_groups:
        group.setdefault("lr_scale", 1.0)
    return opt


def adamw4_transform_of(cfg: PretrainConfig) -> str | None:
    """How a run's AdamW4 stores v: the config's adamw4_transform, else its recipe's (None:
    AdamW4's default)."""
    return cfg.adamw4_transform or get_recipe(cfg.recipe).adamw4_transform


def build_from_config(model: nn.Module, cfg: PretrainConfig, *, fused: bool = False,
                      shard_local: bool = False, rank: int = 0,
                      world_size: int = 1) -> torch.optim.Optimizer:
    """build_optimizer with the optimizer and hyperparameters of `cfg`."""
    return build_optimizer(model, optimizer_of(cfg), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                           weight_decay=cfg.weight_decay, muon_lr=cfg.muon_lr, seed=cfg.seed,
                           fused=fused, adamw4_transform=adamw4_transform_of(cfg),
                           shard_local=shard_local, rank=rank, world_size=world_size)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate to lr x its lr_scale."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
