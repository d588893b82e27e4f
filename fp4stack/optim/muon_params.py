"""Which parameters Muon orthogonalises and which AdamW steps, and the checks of a Muon group.

`split_params(model)` makes the usual split; `route` turns an optimizer's params and
adamw_params into Muon groups followed by AdamW groups (moving what cannot be orthogonalised);
`check_muon_group` names the field of a bad Muon option.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ..config_fields import check_float
from .root_ns import NS_COEFFICIENT_KINDS

ADJUST_LR_FNS = ("original", "match_rms_adamw")


def is_router_name(name: str) -> bool:
    # fp4stack: ...mlp.router.gate; Hugging Face MoEs: ...mlp.gate / block_sparse_moe.gate.
    parts = name.split(".")
    return "router" in parts or parts[-1] == "gate"


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(muon_params, adamw_params) by common Muon practice.

    Muon: 2-D weights of hidden linear layers and 3-D stacked expert weights [E, out, in] (each
    expert matrix orthogonalised on its own). AdamW: embeddings, the LM head (and anything tied to
    an embedding), MoE routers, and every parameter with fewer than 2 dims (norms, biases).
    """
    special: set[int] = set()
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, module in model.named_modules():
        head = name.split(".")[-1] in ("lm_head", "output") or module is output
        if isinstance(module, nn.Embedding) or head or is_router_name(name):
            special.update(id(p) for p in module.parameters())
    muon: list[nn.Parameter] = []
    adamw: list[nn.Parameter] = []
    for p in model.parameters():  # yields each shared (tied) parameter once
        (muon if p.dim() in (2, 3) and id(p) not in special else adamw).append(p)
    return muon, adamw


def as_groups(params: Any) -> list[dict[str, Any]]:
    """params as a list of group dicts, each with a list of tensors."""
    if params is None:
        return []
    if isinstance(params, Tensor):
        raise TypeError("params must be an iterable of tensors or dicts, got a single Tensor")
    items = list(params)
    if items and not isinstance(items[0], dict):
        items = [{"params": items}]
    return [{**g, "params": [g["params"]] if isinstance(g["params"], Tensor)
             else list(g["params"])} for g in items]


def route(params: Any, adamw_params: Any) -> list[dict[str, Any]]:
    """Muon groups (their non-matrix params moved to AdamW groups) followed by AdamW groups."""
    muon, adamw = [], []
    for group in as_groups(params):
        ps = group["params"]
        if not group.setdefault("use_muon", True):
            adamw.append(group)
            continue
        matrices = [p for p in ps if p.dim() in (2, 3)]
        others = [p for p in ps if p.dim() not in (2, 3)]
        if matrices:
            muon.append({**group, "params": matrices})
        if others:  # detected: vectors and scalars cannot be orthogonalised
            adamw.append({"params": others, "use_muon": False})
    return muon + adamw + [{**g, "use_muon": False} for g in as_groups(adamw_params)]


def check_muon_group(group: dict[str, Any]) -> None:
    for p in group["params"]:
        if p.dim() not in (2, 3):
            raise ValueError(f"Muon params must be 2-D or 3-D (stacked experts), got shape "
                             f"{tuple(p.shape)}; pass it in adamw_params")
    lr, mu, wd, steps = group["lr"], group["momentum"], group["weight_decay"], group["ns_steps"]
    if isinstance(lr, Tensor):
        raise ValueError(f"Muon4 takes lr as a float (a tensor lr is not supported), got {lr!r}")
    check_float("Muon4 lr (the learning rate)", lr)
    if not 0.0 <= mu < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {mu!r}")
    if not wd >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {wd!r}")
    if not isinstance(steps, int) or not 1 <= steps < 100:
        raise ValueError(f"ns_steps must be an int in [1, 100), got {steps!r}")
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, "
                         f"got {group['adjust_lr_fn']!r}")
    if group["ns_coefficients"] not in NS_COEFFICIENT_KINDS:
        raise ValueError(f"ns_coefficients must be one of {NS_COEFFICIENT_KINDS}, "
                         f"got {group['ns_coefficients']!r}")
    q = group["outlier_quantile"]
    if q is not None and (isinstance(q, bool) or not isinstance(q, int | float)
                          or not 0.0 < q <= 1.0):
        raise ValueError(f"outlier_quantile must be None (no clipping) or a number in (0, 1], "
                         f"e.g. 0.9 as in ROOT, got {q!r}")
