"""The pretraining optimizers: AdamW (fp32 states) or AdamW4 (NVFP4 states), Muon or Muon4.

Each param group carries `lr_scale`, its learning rate relative to the config's `lr`, so the one
warmup + cosine schedule drives every group (Muon's matrices run at muon_lr, the rest at lr).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

OPTIMIZERS = ("adamw", "adamw4", "muon", "muon4")


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


def build_optimizer(model: nn.Module, name: str, *, lr: float, betas: tuple[float, float],
                    eps: float, weight_decay: float, muon_lr: float, seed: int,
                    fused: bool = False) -> torch.optim.Optimizer:
    """The optimizer `name` (one of OPTIMIZERS) over `model`'s trainable parameters."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {name!r}")
    groups = param_groups(model, weight_decay)
    if name == "adamw":
        opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)
    elif name == "adamw4":
        from ..optim import AdamW4

        opt = AdamW4(groups, lr=lr, betas=betas, eps=eps, seed=seed)
    else:
        from ..optim.muon4 import Muon4, split_params

        matrices, _ = split_params(model)
        ids = {id(p) for p in matrices}
        rest = [{**g, "params": [p for p in g["params"] if id(p) not in ids]} for g in groups]
        opt = Muon4([{"params": [p for p in matrices if p.requires_grad]}], lr=muon_lr,
                    weight_decay=weight_decay, quantize=name == "muon4",
                    adamw_params=[g for g in rest if g["params"]], adamw_lr=lr,
                    adamw_betas=betas, adamw_eps=eps, seed=seed)
        for group in opt.param_groups:
            group["lr_scale"] = muon_lr / lr if group.get("use_muon") else 1.0
    for group in opt.param_groups:
        group.setdefault("lr_scale", 1.0)
    return opt


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate to lr x its lr_scale."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
