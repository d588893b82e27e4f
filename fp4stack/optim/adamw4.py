"""AdamW with both moments stored in NVFP4 (1.125 bytes per parameter instead of 8).

The optimizer: its options, the dispatch of each parameter to one of three steps (the fused
Triton step, adamw4_fused; the reference step here, with the states of adamw4_state; or one
multi-tensor fp32 step for the tensors that keep fp32 states), and its state_dict. How the
moments are encoded is a `StateFormat` (state_format); how the defaults were chosen and what they
cost against fp32 AdamW is measured in docs/results/optimizers.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ..config_fields import check_float
from ..kernels import interpreted
from .adamw4_fused import (
    fused_steps,
    grad_still_fusable,
    param_unfusable,
    unfusable,
)
from .adamw4_state import (
    init_state,
    keeps_fp32_state,
    read_moments,
    store_moments,
    upgrade_state,
)
from .adamw_updates import adamw_update, adamw_update_foreach, quantized_update
from .state_format import DEFAULT_FORMAT, GROUP_KEYS, StateFormat


class AdamW4(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) with m and v held as NVFP4.

    Each moment of a large matrix is an NVFP4 tensor (1x16 blocks along the last dim, E4M3 block
    scales, fp32 global amax; see adamw4_state for the state tensors): 1.125 bytes per parameter
    for m and v together, against 8 for fp32 AdamW (the default rank-1 transform of v adds 4
    bytes per row and per column). Each step reads m and v back, updates parameter, m and v in
    fp32 with torch AdamW's operations (the current gradient enters at full precision), then
    quantizes them again with stochastic rounding. v is stored through a rank-1 normalisation
    of its square root, zero codes of v read back as the largest value they can stand for (so
    m / sqrt(v) cannot explode), and m is stored over the root of v, so rows whose gradients
    are 1e-8 of the tensor's largest keep their momentum.

    1-D tensors (norms, biases), tensors under `min_numel` elements and tensors whose last dim
    is not a multiple of 16 keep fp32 states; those of float32 parameters take one multi-tensor
    update per group, torch's foreach AdamW's ops (others, torch's single-tensor ops), so on
    them AdamW4 equals torch.optim.AdamW bit for bit (foreach=True on CUDA; on the CPU the
    foreach ops run the single-tensor kernels: foreach=False).

    Args:
        min_numel: tensors smaller than this keep fp32 states.
        seed: base seed of the stochastic rounding (a state's seed also depends on the
            parameter's index in the groups and the step, so a run repeats bit for bit).
        fused: run the quantized states of a group in one fused Triton step
            (kernels/adamw4.py), bit-exact with the reference step. None: where Triton is
            installed and the parameter is float32 and on CUDA; other parameters take the
            reference step. True: require it (a ValueError says why not; on the CPU it runs
            under TRITON_INTERPRET=1, for tests). False: never. The state_dict is the same
            either way, so a run may switch.
        cuda_graphs: on CUDA, the fused step captures its launches as a CUDA graph (at its
            third step with the same tensors) and replays it, which spares the launches' host
            time (the same kernels: the same bits). A step called inside another CUDA graph
            capture is an error.
        state_format: for studies: how the moments are encoded (StateFormat); the default is
            the method. Other formats take the reference step (fused=True refuses them, except
            another headroom).
    lr, betas, eps, weight_decay, min_numel and seed may differ per param group; a parameter's
    state layout is fixed at its first step. maximize, amsgrad and foreach are not implemented
    (a ValueError if set). Between steps the fused step holds, besides the states, its launch
    tables (~200 bytes per tensor and 4 per 1024 elements) and float64 sums and float32 roots of
    v's factors (16 bytes per row and per column), none of them counted by `state_bytes`.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        min_numel: int = 4096,
        seed: int = 0,
        maximize: bool = False,
        amsgrad: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        cuda_graphs: bool = True,
        state_format: StateFormat = DEFAULT_FORMAT,
    ) -> None:
        for name, flag in (("maximize", maximize), ("amsgrad", amsgrad), ("foreach", foreach)):
            if flag:
                raise ValueError(f"AdamW4 does not implement {name}={flag!r}")
        if fused not in (None, True, False):
            raise ValueError(f"fused must be None, True or False, got {fused!r}")
        if not isinstance(state_format, StateFormat):
            raise ValueError(f"state_format must be a StateFormat, got {state_format!r}")
        if fused and (reason := unfusable(state_format)):
            raise ValueError(f"AdamW4(fused=True): {reason}")
        # Set before super().__init__, which adds the groups (and checks them).
        self.fused = fused
        self.cuda_graphs = cuda_graphs
        self.state_format = state_format
        self._reset_fused()
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        min_numel=min_numel, seed=seed)
        super().__init__(params, defaults)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "fused": self.fused, "cuda_graphs": self.cuda_graphs,
                "state_format": self.state_format}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Pickling keeps the options but not the fused step's device tables and graphs.
        super().__setstate__(state)
        self.__dict__.setdefault("fused", None)
        self.__dict__.setdefault("cuda_graphs", True)
        self.__dict__.setdefault("state_format", DEFAULT_FORMAT)
        self._reset_fused()

    def _reset_fused(self) -> None:
        """Forget the fused step's plans (device tables, buffers, CUDA graphs) and caches."""
        self._plans: dict = {}
        self._step_views: dict = {}
        self._fusable_ids: set[int] = set()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        for key in GROUP_KEYS.values():
            if key in param_group:
                raise ValueError(
                    f"AdamW4: {key!r} is not a param-group option; the state format is the "
                    "optimizer's, for studies: AdamW4(..., state_format=StateFormat(...))")
        _check_group({**self.defaults, **param_group})
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step; params without a gradient are skipped."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        fused = self.fused is not False and not unfusable(self.state_format)
        on_cpu = bool(self.fused) and interpreted()  # the kernel under the interpreter
        # A parameter's index in the flattened groups is part of its SR seed: stable across a
        # state_dict round trip, so a reloaded run draws the same bits.
        index = 0
        for group in self.param_groups:
            batch, indices, fp32 = [], [], []
            for p in group["params"]:
                grad = p.grad
                if grad is not None:
                    if fused and (self._still_fusable(p, grad)
                                  or self._fusable(p, group, on_cpu)):
                        batch.append(p)
                        indices.append(index)
                    elif self._fp32_batchable(p, group):
                        fp32.append(p)
                    else:
                        self._step_param(p, group, index)
                index += 1
            if batch:
                states = self._states(batch, group)
                fused_steps(batch, indices, states, self._count_steps(states), group,
                            self.state_format.headroom, self._plans, self.cuda_graphs)
            if fp32:
                self._fp32_step(fp32, group)
        return loss

    def _states(self, params: list[Tensor], group: dict[str, Any]) -> list[dict[str, Tensor]]:
        """The states of `params`, created where they have none yet."""
        states = []
        for p in params:
            state = self.state[p]
            if not state:
                init_state(p, self.state_format, group["min_numel"], state)
            states.append(state)
        return states

    def _still_fusable(self, p: Tensor, grad: Tensor) -> bool:
        """For a parameter `_fusable` accepted before, the checks that can change from step to
        step. The parameter's own storage is part of the fused step's plan key: a plan for a
        new one checks it again."""
        return id(p) in self._fusable_ids and grad_still_fusable(grad)

    def _fusable(self, p: Tensor, group: dict[str, Any], on_cpu: bool) -> bool:
        """Whether p (with a gradient, in a fusable group) takes the fused step: quantized
        states and adamw4_fused.param_unfusable's conditions. With fused=True, a quantized
        parameter that cannot is an error."""
        state = self.state[p]
        if "exp_avg" in state or (not state and keeps_fp32_state(p, group["min_numel"])):
            return False
        reason = param_unfusable(p, p.grad, on_cpu)
        if reason is None:
            self._fusable_ids.add(id(p))
            return True
        if self.fused:
            raise ValueError(f"AdamW4(fused=True): {reason}")
        return False

    def _fp32_batchable(self, p: Tensor, group: dict[str, Any]) -> bool:
        """Whether p (with a gradient) keeps fp32 states and takes the batched fp32 step: a
        float32 parameter with a dense float32 gradient."""
        state = self.state[p]
        if state:
            if "exp_avg" not in state:
                return False
        elif self.state_format.quantized and not keeps_fp32_state(p, group["min_numel"]):
            return False
        grad = p.grad
        return (p.dtype == torch.float32 and grad.dtype == torch.float32
                and grad.layout == torch.strided)

    def _fp32_step(self, params: list[Tensor], group: dict[str, Any]) -> None:
        """The fp32-state parameters of a group in one set of multi-tensor (foreach) ops, those
        of torch.optim.AdamW(foreach=True) in its order: one launch per op for all of them on
        CUDA, instead of several per parameter."""
        states = self._states(params, group)
        adamw_update_foreach(
            params, [p.grad for p in params], [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states], self._count_steps(states), group["lr"],
            *group["betas"], group["eps"], group["weight_decay"])

    def _count_steps(self, states: list[dict[str, Tensor]]) -> list[float]:
        """Add 1 to the states' "step" counters and return them.

        The counters of a set of parameters stepped together become 0-d views of one tensor, so
        this is one addition, not one per parameter (tens of microseconds a step). They stay
        float32 0-d CPU tensors, as torch and the reference step keep them.
        """
        key = tuple(id(s["step"]) for s in states)
        entry = self._step_views.get(key)
        if entry is None:
            flat = torch.stack([s["step"] for s in states])
            for i, s in enumerate(states):
                s["step"] = flat[i]
            views = [s["step"] for s in states]
            if len(self._step_views) >= 8:
                self._step_views.clear()
            # The views are kept here, so the ids in the key are not reused while it is.
            entry = self._step_views[tuple(map(id, views))] = (flat, views)
        entry[0].add_(1.0)
        return entry[0].tolist()

    def _step_param(self, p: Tensor, group: dict[str, Any], index: int) -> None:
        """The reference step of one parameter (any state format, dtype or device)."""
        grad = p.grad
        if grad.is_sparse:
            raise RuntimeError(
                "AdamW4 does not support sparse gradients; use torch.optim.SparseAdam"
            )
        if torch.is_complex(p):
            raise RuntimeError("AdamW4 does not support complex parameters")
        state = self._states([p], group)[0]
        state["step"] += 1
        step = float(state["step"].item())

        quantized = "exp_avg_data" in state
        if quantized:
            exp_avg, exp_avg_sq = read_moments(state, self.state_format, p.shape)
        else:
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]

        p32 = p if p.dtype == torch.float32 else p.detach().float()
        beta1, beta2 = group["betas"]
        update = quantized_update if quantized else adamw_update
        update(p32, grad.float(), exp_avg, exp_avg_sq, step, group["lr"], beta1, beta2,
               group["eps"], group["weight_decay"])
        if p32 is not p:
            p.copy_(p32)
        if quantized:
            store_moments(state, self.state_format, group["seed"], index, int(step), exp_avg,
                          exp_avg_sq)

    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict, with the state format in every param group under the keys
        AdamW4 has always saved it with (transform, state_rounding, first_moment, scaling,
        headroom), so checkpoints keep their layout."""
        sd = super().state_dict()
        fields = self.state_format.group_fields()
        sd["param_groups"] = [{**g, **fields} for g in sd["param_groups"]]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict, with the state format its groups were saved with (as torch's
        loader restores the groups' options); NVFP4 fields and fp32 states keep their dtypes.

        torch's loader casts every floating state tensor to its parameter's dtype, which would
        turn the packed uint8 codes into floats (and fp32 states of a bf16 parameter into bf16),
        so the loaded states are put back as saved.
        """
        fmt = StateFormat.from_saved_groups(state_dict["param_groups"])
        if self.fused and (reason := unfusable(fmt)):
            raise ValueError(f"AdamW4(fused=True) cannot load this state_dict: {reason}")
        keys = set(GROUP_KEYS.values())
        groups = [{k: v for k, v in g.items() if k not in keys}
                  for g in state_dict["param_groups"]]
        super().load_state_dict({**state_dict, "param_groups": groups})
        self.state_format = fmt
        self._reset_fused()
        saved_ids = [i for g in groups for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params, strict=True):
            if pid in state_dict["state"]:
                self.state[p] = {
                    k: v.detach().clone().to(p.device) if isinstance(v, Tensor) else v
                    for k, v in state_dict["state"][pid].items()
                }
                # torch keeps "step" on the CPU unless capturable; so do we.
                self.state[p]["step"] = self.state[p]["step"].cpu()
                upgrade_state(self.state[p])

    def state_bytes(self) -> int:
        """Bytes held by the states: NVFP4 data, scales and amax, fp32 fallbacks, step counters."""
        return sum(
            v.numel() * v.element_size()
            for s in self.state.values()
            for v in s.values()
            if isinstance(v, Tensor)
        )


def _check_group(group: dict[str, Any]) -> None:
    if isinstance(group["lr"], Tensor):
        raise ValueError("AdamW4 takes lr as a float (a tensor lr is not supported)")
    check_float("AdamW4 lr (the learning rate)", group["lr"])
    for name in ("eps", "weight_decay"):
        check_float(f"AdamW4 {name}", group[name])
    betas = group["betas"]
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not isinstance(group["min_numel"], int) or group["min_numel"] < 0:
        raise ValueError(f"min_numel must be an int >= 0, got {group['min_numel']!r}")
    if not isinstance(group["seed"], int) or group["seed"] < 0:
        raise ValueError(f"seed must be an int >= 0, got {group['seed']!r}")
