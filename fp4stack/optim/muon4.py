"""Muon with NVFP4 Newton-Schulz and an NVFP4 momentum buffer.

Muon orthogonalises the (Nesterov) momentum of each hidden weight matrix with a quintic
Newton-Schulz iteration and steps along the result. Muon4 runs that iteration with every GEMM
operand quantized to NVFP4 (1x16 blocks along the GEMM's reduction dim, fp32 accumulation) and
keeps the momentum buffer as NVFP4 (0.5625 bytes per parameter instead of 4). Parameters that Muon
should not touch (embeddings, LM head, norms, biases, routers) are stepped by AdamW4 inside the
same optimizer, so one `.step()` updates the whole model.

`quantize=False` is plain Muon in the same optimizer (only the Newton-Schulz step and the momentum
storage change): its results equal torch.optim.Muon's bit for bit (bf16 Newton-Schulz, the same
lr conventions) and the other parameters get torch's fp32 AdamW.

Two per-group options turn it into ROOT (arXiv 2511.20626; optim/root.py names the pair):
`ns_coefficients="root"` (shape-adaptive Newton-Schulz coefficients) and `outlier_quantile`
(the soft-threshold of outliers before orthogonalising); see optim/root_ns.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ..api import dequantize, quantize
from ..formats.random import lowbias32_int
from ..formats.spec import QuantSpec
from ..formats.tensor import NVFP4Tensor
from .adamw4 import AdamW4
from .muon_params import (  # noqa: F401 (split_params: imported from here by users)
    ADJUST_LR_FNS,
    check_muon_group,
    route,
    split_params,
)
from .newton_schulz import (
    _NS_DTYPES,
    NS_SPEC,
    GraphedNewtonSchulz,
    newton_schulz,  # noqa: F401 (imported from here by callers)
    orthogonalize,
)
from .root_ns import clip_outliers, ns_coefficients
from .shard_local import ShardLocal, local_shard, shard_of
from .state_format import StateFormat

_ROUNDINGS = ("stochastic", "rne")
_FIELDS = ("data", "scales", "amax")
_SEED_SALT = 0x4D554F4E  # keeps Muon4's rounding bits apart from AdamW4's for the same seed


def adjusted_lr(lr: float, rows: int, cols: int, adjust_lr_fn: str = "original") -> float:
    """The step size of one (rows x cols) matrix, as torch.optim.Muon's adjust_lr_fn defines it.

    "original" (Keller Jordan): lr * sqrt(max(1, rows / cols)), so the update's RMS does not shrink
    for tall matrices; lr around 0.02. "match_rms_adamw" (Moonshot): lr * 0.2 * sqrt(max(rows,
    cols)), an update RMS like AdamW's, so AdamW's lr and weight decay carry over.
    """
    if adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")


def state_seed(seed: int, param_index: int, matrix: int, step: int) -> int:
    """Seed of the stochastic rounding of one momentum matrix at one step (fresh bits every
    step, yet a run, or a run resumed from a state_dict, repeats bit for bit)."""
    h = lowbias32_int((seed ^ (seed >> 32)) ^ _SEED_SALT)
    for v in (param_index, matrix, step):
        h = lowbias32_int(h ^ lowbias32_int(v ^ (v >> 32)))
    return h


class Muon4(torch.optim.Optimizer):
    """Muon for hidden matrices, with NVFP4 Newton-Schulz operands and NVFP4 momentum, plus
    AdamW4 for every other parameter, in one optimizer.

    Per Muon matrix W (rows x cols) with gradient G and momentum M (torch.optim.Muon's form):
        M <- momentum * M + (1 - momentum) * G
        U  = (1 - momentum) * G + momentum * M  if nesterov else M
        W <- W * (1 - lr * weight_decay) - adjusted_lr(lr, rows, cols) * NS(U)
    with adjusted_lr "original": lr * sqrt(max(1, rows / cols)). A 3-D parameter [E, out, in]
    (stacked experts) is E matrices, each with its own NS and its own NVFP4 momentum scale.

    quantize=True: NS GEMM operands in NVFP4 (RNE, 1x16 along each reduction dim, fp32
    accumulation) and the momentum stored as NVFP4 (1x16 blocks, one amax per matrix) with
    `state_rounding`. "stochastic" is the default because it is unbiased: under noisy gradients
    RNE's rounding errors repeat from step to step and pile up (stored momentum 0.44-0.50 away
    from the fp32 EMA after 100-200 steps, against a steady 0.38 with SR); the loss of a tiny GPT
    did not tell the two apart. The AdamW part is AdamW4 with its defaults.
    quantize=False: bf16 NS, fp32 momentum and torch's AdamW, i.e. torch.optim.Muon plus
    torch.optim.AdamW. quantize_ns / quantize_state set the two Muon halves separately.
    cuda_graphs=True: on CUDA each matrix shape's Newton-Schulz is captured once as a CUDA
    graph and replayed (the same kernels, so the same bits; the step is otherwise bound by
    hundreds of small kernel launches per matrix).
    batched_ns=True: the matrices of one shape in a group (2-D params and the experts of 3-D
    ones alike) are orthogonalised together (newton_schulz_batched: one batched GEMM per GEMM
    of a step, each NVFP4 operand still quantized per matrix with its own amax; on CUDA one
    graph per stack). Its results are the per-matrix ones where bmm sums as mm does (the
    CPU's); it holds the stack's updates and Newton-Schulz temporaries at once.
    ns_coefficients: "muon" (Keller Jordan's, every shape) or "root" (per matrix shape,
    optim/root_ns.root_coefficients). outlier_quantile: None (no clipping) or q in (0, 1]: U is
    replaced by clamp(U, -eps, eps), eps the q-quantile of |U| per matrix, before Newton-Schulz
    (ROOT's soft-threshold split, optim/root_ns.clip_outliers). Both may differ per group.
    adamw_state_format: the StateFormat of the AdamW4 part (quantize=True; None: its default).

    FSDP2's sharded parameters (DTensors on one 1-D mesh) are stepped where they live: the
    momentum half on each rank's rows (an NVFP4 momentum of its own per rank), Newton-Schulz on
    each 2-D matrix's update gathered whole, every rank adding its rows of the result; a 3-D
    stack is sharded by whole experts. Its state_dict is then this rank's (with its rank).

    Which parameters get AdamW: `adamw_params` (tensors or groups), groups of `params` marked
    {"use_muon": False}, and every parameter of `params` with fewer than 2 or more than 3 dims.
    `split_params(model)` makes the usual split. LR schedulers see all groups; an AdamW group's
    lr, betas, eps and weight_decay are passed to the inner AdamW at each step.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        *,
        quantize: bool = True,
        adamw_params: Iterable[Tensor] | Iterable[dict[str, Any]] | None = None,
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        seed: int = 0,
        adjust_lr_fn: str = "original",
        ns_dtype: torch.dtype = torch.bfloat16,
        state_rounding: str = "stochastic",
        quantize_ns: bool | None = None,
        quantize_state: bool | None = None,
        cuda_graphs: bool = True,
        ns_coefficients: str = "muon",
        outlier_quantile: float | None = None,
        adamw_state_format: StateFormat | None = None,
        batched_ns: bool = True,
    ) -> None:
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        if ns_dtype not in _NS_DTYPES:
            raise ValueError(f"ns_dtype must be one of {_NS_DTYPES}, got {ns_dtype}")
        if state_rounding not in _ROUNDINGS:
            raise ValueError(f"state_rounding must be one of {_ROUNDINGS}, "
                             f"got {state_rounding!r}")
        self.quantize = quantize
        self.quantize_ns = quantize if quantize_ns is None else quantize_ns
        self.quantize_state = quantize if quantize_state is None else quantize_state
        self.seed, self.ns_dtype, self.state_rounding = seed, ns_dtype, state_rounding
        if not isinstance(batched_ns, bool):
            raise ValueError(f"batched_ns must be True or False, got {batched_ns!r}")
        self.batched_ns = batched_ns
        if adamw_state_format is not None and not isinstance(adamw_state_format, StateFormat):
            raise ValueError(f"adamw_state_format must be a StateFormat or None, got "
                             f"{adamw_state_format!r}")
        self.adamw_state_format = adamw_state_format
        # CUDA matrices: Newton-Schulz replayed from one CUDA graph per shape (same bits).
        self._ns = GraphedNewtonSchulz() if cuda_graphs else orthogonalize
        self.muon_defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov,
                                  weight_decay=weight_decay, ns_steps=ns_steps,
                                  adjust_lr_fn=adjust_lr_fn, ns_coefficients=ns_coefficients,
                                  outlier_quantile=outlier_quantile, use_muon=True)
        self.adamw_defaults = dict(lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
                                   weight_decay=adamw_weight_decay, use_muon=False)
        self.adamw: torch.optim.Optimizer | None = None
        groups = route(params, adamw_params)
        # (rank, world size) when the parameters are FSDP2's shards (DTensors), else None.
        self._shard = shard_of([p for g in groups for p in g["params"]])
        self.shard_local = self._shard is not None
        # Empty torch defaults: each group is filled from the defaults of its own kind instead.
        super().__init__(groups, {})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        kind = param_group.setdefault("use_muon", True)
        for key, value in (self.muon_defaults if kind else self.adamw_defaults).items():
            param_group.setdefault(key, value)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if kind:
            check_muon_group(group)
        else:
            self._add_adamw_group(group)

    def _add_adamw_group(self, group: dict[str, Any]) -> None:
        inner = {"params": group["params"], **_adamw_hyper(group)}
        if self.adamw is not None:
            self.adamw.add_param_group(inner)
        elif self.quantize:
            fmt = {} if self.adamw_state_format is None else {
                "state_format": self.adamw_state_format}
            if self._shard is None:
                self.adamw = AdamW4([inner], seed=self.seed, **fmt)
            else:  # FSDP2's shards: AdamW4 steps this rank's rows (optim.shard_local)
                self.adamw = ShardLocal([{**inner, "seed": self.seed}],
                                        lambda groups: AdamW4(groups, **fmt), *self._shard)
        else:
            self.adamw = torch.optim.AdamW([inner], foreach=False)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of Muon on the matrices and AdamW on the rest; params without grad skip."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0  # position among the Muon params: part of the SR seed, stable across reloads
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            updates = []
            for p in group["params"]:
                if p.grad is not None:
                    updates.append((p, self._momentum_step(p, group, index)))
                index += 1
            self._orthogonal_steps(updates, group)
        if self.adamw is not None:
            outer = [g for g in self.param_groups if not g["use_muon"]]
            for mine, inner in zip(outer, self.adamw.param_groups, strict=True):
                inner.update(_adamw_hyper(mine))  # schedulers change the outer groups
            self.adamw.step()
        return loss

    def _momentum_step(self, p: Tensor, group: dict[str, Any], index: int) -> Tensor:
        """The momentum and weight-decay half of p's step; returns its update U (fp32), of p's
        local rows when p is sharded (FSDP2's DTensor)."""
        grad = local_shard(p.grad)
        if grad.is_sparse:
            raise RuntimeError("Muon4 does not support sparse gradients")
        if torch.is_complex(p):
            raise RuntimeError("Muon4 does not support complex parameters")
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["step"] += 1
        step = int(state["step"].item())
        mu = group["momentum"]
        g = grad.float()
        local = local_shard(p)
        buf = self._load_momentum(local, state)
        buf.lerp_(g, 1 - mu)
        update = g.lerp(buf, mu) if group["nesterov"] else buf
        if self.quantize_state:
            self._store_momentum(local, state, buf, self._seed_index(index), step)
        else:
            state["momentum_buffer"] = buf
        local.mul_(1 - group["lr"] * group["weight_decay"])
        return update

    def _seed_index(self, index: int) -> int:
        # A sharded momentum's rounding draws differ per rank (each rank's rows are their own
        # NVFP4 tensors): the rank is folded into the parameter's index.
        return index if self._shard is None else index * self._shard[1] + self._shard[0]

    def _orthogonal_steps(self, updates: list[tuple[Tensor, Tensor]],
                          group: dict[str, Any]) -> None:
        """W <- W - adjusted_lr * NS(U) for each (p, U) of a group: per matrix, or with
        batched_ns the matrices of each shape as one stack (a lone matrix on its own)."""
        by_shape: dict[tuple[int, int], list[tuple[Callable, Tensor]]] = {}
        for p, update in updates:
            rows, cols = p.shape[-2:]
            apply, whole = _whole_matrices(p, update)
            by_shape.setdefault((rows, cols), []).append((apply, whole.view(-1, rows, cols)))
        for (rows, cols), pairs in by_shape.items():
            lr_adj = adjusted_lr(group["lr"], rows, cols, group["adjust_lr_fn"])
            # Groups saved before ROOT's options existed lack them: plain Muon.
            coefficients = ns_coefficients(group.get("ns_coefficients", "muon"), rows, cols,
                                           group["ns_steps"])
            if not self.batched_ns or sum(len(us) for _, us in pairs) == 1:
                for apply, us in pairs:
                    apply(torch.stack([self._orthogonalise(u, group, coefficients) for u in us]),
                          -lr_adj)
                continue
            out = self._orthogonalise(torch.cat([us for _, us in pairs]), group, coefficients)
            start = 0
            for apply, us in pairs:
                apply(out[start:start + len(us)], -lr_adj)
                start += len(us)

    def _orthogonalise(self, u: Tensor, group: dict[str, Any],
                       coefficients: tuple[float, float, float]) -> Tensor:
        """NS(U) of a matrix or a stack [B, rows, cols], after ROOT's outlier clipping (each
        matrix's own threshold) when the group asks for it."""
        quantile = group.get("outlier_quantile")
        if quantile is not None:
            u = clip_outliers(u, quantile)
        spec = NS_SPEC if self.quantize_ns else None
        return self._ns(u, group["ns_steps"], spec, dtype=self.ns_dtype,
                        coefficients=coefficients)

    def _state_spec(self) -> QuantSpec:
        return QuantSpec(rounding=self.state_rounding, nan_policy="propagate")

    def _load_momentum(self, p: Tensor, state: dict[str, Any]) -> Tensor:
        """The momentum as fp32 [*p.shape] (zeros at the first step)."""
        if "momentum_buffer" in state:
            return state["momentum_buffer"]
        if "momentum_data" not in state:
            return torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        rows, cols = p.shape[-2:]
        fields = [state[f"momentum_{f}"] for f in _FIELDS]
        data, scales = (t.view(-1, rows, t.shape[-1]) for t in fields[:2])
        mats = [
            dequantize(NVFP4Tensor(d, s, a, (rows, cols), self._state_spec()))
            for d, s, a in zip(data, scales, fields[2].reshape(-1), strict=True)
        ]
        return _stacked(mats).view(p.shape)

    def _store_momentum(self, p: Tensor, state: dict[str, Any], buf: Tensor, index: int,
                        step: int) -> None:
        """Quantize each momentum matrix on its own (own amax) and keep the stacked fields."""
        rows, cols = p.shape[-2:]
        spec = self._state_spec()
        qs = [quantize(m, spec=spec, seed=state_seed(self.seed, index, e, step))
              for e, m in enumerate(buf.view(-1, rows, cols))]
        lead = p.shape[:-2]
        state["momentum_data"] = _stacked([q.data for q in qs]).view(*lead, rows, -1)
        state["momentum_scales"] = _stacked([q.scales for q in qs]).view(*lead, rows, -1)
        state["momentum_amax"] = _stacked([q.amax for q in qs]).view(lead)

    def state_dict(self) -> dict[str, Any]:
        """torch's layout for the Muon states, plus the inner AdamW's under "adamw"."""
        sd = super().state_dict()
        if self.adamw is not None:
            sd["adamw"] = self.adamw.state_dict()
        if self._shard is not None:  # this rank's rows: checkpoints gather every rank's
            sd["rank"], sd["world_size"] = self._shard
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict of a Muon4 with the same groups; states keep their saved dtypes.

        torch's loader casts floating states to the parameter's dtype (E4M3 scales to fp32, the
        fp32 amax and momentum to a bf16 parameter's dtype), so the saved tensors are put back.
        """
        sd = dict(state_dict)
        inner = sd.pop("adamw", None)
        shard = (sd.pop("rank", None), sd.pop("world_size", None))
        if shard != (self._shard or (None, None)):
            raise ValueError(f"this Muon4 state was saved from {_where(shard)}, this optimizer "
                             f"is {_where(self._shard)}: sharded states resume as they were "
                             "saved")
        if (inner is None) != (self.adamw is None):
            raise ValueError("state_dict and optimizer disagree on having AdamW parameters")
        super().load_state_dict(sd)
        saved_ids = [i for g in sd["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params, strict=True):
            if pid in sd["state"]:
                self.state[p] = {k: v.detach().clone().to(p.device) if k != "step" else
                                 v.detach().clone() for k, v in sd["state"][pid].items()}
        if inner is not None:
            self.adamw.load_state_dict(inner)

    def state_bytes(self) -> int:
        """Bytes held by all states (Muon momentum, step counters and the inner AdamW's)."""
        own = sum(v.numel() * v.element_size() for s in self.state.values()
                  for v in s.values() if isinstance(v, Tensor))
        if self.adamw is None:
            return own
        if isinstance(self.adamw, AdamW4 | ShardLocal):
            return own + self.adamw.state_bytes()
        return own + sum(v.numel() * v.element_size() for s in self.adamw.state.values()
                         for v in s.values() if isinstance(v, Tensor))


def _stacked(tensors: list[Tensor]) -> Tensor:
    # One matrix (every 2-D parameter) is a view, not a copy: a launch fewer per field and step.
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)


def _whole_matrices(p: Tensor, update: Tensor) -> tuple[Callable[[Tensor, float], None], Tensor]:
    """(apply(out, alpha): p += alpha * out, the update's whole matrices U): U is `update`
    itself, except for a 2-D matrix FSDP2 shards by rows, whose rows are gathered from every
    rank; its apply then adds this rank's rows of the result. (A 3-D stack is sharded by
    whole experts, each its own matrix.)"""
    if not hasattr(p, "device_mesh") or p.dim() != 2:
        local = local_shard(p)
        return (lambda out, alpha: local.add_(out.view(local.shape), alpha=alpha)), update
    from torch.distributed.tensor import DTensor, Replicate

    mesh, placements = p.device_mesh, p.placements
    whole = DTensor.from_local(update, mesh, placements, run_check=False, shape=p.shape,
                               stride=p.stride()).full_tensor()
    local = local_shard(p)

    def apply(out: Tensor, alpha: float) -> None:
        mine = DTensor.from_local(out.view(p.shape), mesh, [Replicate()] * mesh.ndim,
                                  run_check=False).redistribute(mesh, placements).to_local()
        local.add_(mine, alpha=alpha)

    return apply, whole


def _where(shard: tuple | None) -> str:
    return ("unsharded parameters" if shard is None or shard[0] is None
            else f"rank {shard[0]} of {shard[1]} FSDP2 ranks")


def _adamw_hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")}
