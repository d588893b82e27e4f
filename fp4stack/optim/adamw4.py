"""AdamW with both moments stored in NVFP4 (1.125 bytes per parameter instead of 8).

Defaults chosen by experiments/study_adamw4_transforms.py (200 steps, 2 seeds, gap of the final
eval loss to fp32 torch AdamW; tiny GPT on a Zipf-Markov stream / MLP whose input scales span
two decades / matrix whose rows' gradients span eight decades; docs/RESULTS.md):

    transform="rank1", state_rounding="stochastic", first_moment="normalized":
        -0.75% / +5.7% / -2.1%, the only setting within 6% of fp32 AdamW on all three.
    the same with state_rounding="rne":              +0.4% / +26% / +59%
    with first_moment="direct" (m stored as is):     -0.9% / -1.3% / +329% (rare rows freeze)
    transform="pow4" (v^(1/4)), stochastic, m/sqrt(v): -0.7% / +8.5% / -5.6%
    transform="sqrt", stochastic, m/sqrt(v):         -0.5% / +44% / +279%
    raw v, stochastic, m:                            -0.3% / +71% / +754%
    "log" diverges with stochastic rounding; "rsqrt" is +0.6% / +50% / +373%.
The GPT barely separates the settings (all within 1.5% except log); the other two tasks hold the
failure modes: v spanning decades inside a 16-block, and gradients spanning decades across rows.

scaling="delayed" (each moment encoded with `headroom` x its previous amax, so the fused step
needs two passes instead of four) was chosen for speed and measured on the `small` GPT preset
(H200): -0.70% against fp32 AdamW with headroom 4, where headroom 2 fell 3.4% behind early in
training; on the small tasks above it costs a few points on the second (+3.4% with "current").
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ..api import dequantize, quantize
from ..formats.random import lowbias32_int
from ..formats.spec import QuantSpec
from ..formats.tensor import BLOCK, NVFP4Tensor
from .adamw_updates import adamw_update, adamw_update_foreach, quantized_update
from .state_transforms import (
    TRANSFORMS,
    Transform,
    encode_state,
    get_transform,
    read_state,
    safe_divide,
    sqrt_rn,
)

DEFAULT_TRANSFORM = "rank1"
DEFAULT_ROUNDING = "stochastic"
DEFAULT_FIRST_MOMENT = "normalized"
DEFAULT_SCALING = "delayed"
_ROUNDINGS = ("stochastic", "rne")
_FIRST_MOMENTS = ("normalized", "direct")
_SCALINGS = ("delayed", "current")
# Delayed scaling encodes a moment with `headroom` x the amax its stored form had at the
# previous step, so it may grow by that much in a step before its largest blocks saturate.
# Chosen by measurement (docs/RESULTS.md, one run each): with 2 the `small` preset fell behind
# early in training (+3.4% val loss at step 100), with 4 it tracked fp32 AdamW throughout.
DEFAULT_HEADROOM = 4.0
# transform="none" keeps every state in fp32: AdamW4 then computes exactly what torch's AdamW does.
_NONE = "none"
# The NVFP4 fields of a quantized moment, kept as separate state tensors.
_FIELDS = ("data", "scales", "amax")
_MOMENTS = ("exp_avg", "exp_avg_sq")


def keeps_fp32_state(p: Tensor, min_numel: int) -> bool:
    """The fallback rule: 1-D tensors, tensors under `min_numel` elements, and tensors whose last
    dim is not a multiple of 16 keep fp32 states (they are cheap, and padding would waste bytes)."""
    return p.dim() < 2 or p.numel() < min_numel or p.shape[-1] % BLOCK != 0


def state_seed(seed: int, param_index: int, step: int, moment: int) -> int:
    """Seed of the stochastic rounding of one moment of one parameter at one step.

    Every quantization draws fresh bits (a seed reused across steps would round the same
    elements the same way each time and bias the state), yet a run repeats bit for bit.
    """
    h = lowbias32_int(seed ^ (seed >> 32))
    for x in (param_index, step, moment):
        h = lowbias32_int(h ^ lowbias32_int(x ^ (x >> 32)))
    return h


class AdamW4(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) with m and v held as NVFP4.

    Each moment of a large matrix is an NVFP4 tensor (1x16 blocks along the last dim, E4M3 block
    scales, fp32 global amax) kept as three state tensors `<moment>_data` (uint8, two codes per
    byte), `<moment>_scales` (float8_e4m3fn) and `<moment>_amax` (fp32 0-d): 1.125 bytes per
    parameter for m and v together, against 8 for fp32 AdamW ("rank1" adds 4 bytes per row and
    per column). Each step reads m and v back, updates parameter, m and v in fp32 with exactly
    torch AdamW's operations (the current gradient enters at full precision), then quantizes
    them again with `state_rounding`.

    v is stored through `transform` (see state_transforms); zero codes of v read back as the
    largest value they can stand for, so v is never underestimated to zero and m / sqrt(v)
    cannot explode. m is stored either as m / sqrt(v_read) ("normalized": the per-coordinate
    step direction, O(1) on every coordinate, so rows whose gradients are 1e-8 of the tensor's
    largest keep their momentum) or as it is ("direct"). m is signed; a zero m is a zero step.

    Which tensors keep fp32 `exp_avg` and `exp_avg_sq`: 1-D tensors (norms, biases), tensors
    with fewer than `min_numel` elements, and tensors whose last dim is not a multiple of 16;
    with transform="none", all of them. Those of float32 parameters take one multi-tensor update
    per group, torch's foreach AdamW's ops (others, torch's single-tensor ops), so AdamW4 then
    equals torch.optim.AdamW bit for bit (foreach=True on CUDA; on the CPU the foreach ops run
    the single-tensor kernels: foreach=False).

    Args:
        transform: how v is stored: "rank1", "sqrt", "pow4", "log", "rsqrt", "v" (raw), or
            "none" (fp32 states).
        state_rounding: "stochastic" (unbiased, so EMA increments below FP4's spacing are not
            lost; reproducible: the seed depends on `seed`, the parameter's index in the groups
            and the step) or "rne" (round to nearest; small increments vanish, states go stale).
        first_moment: "normalized" (store m / sqrt(v)) or "direct" (store m).
        scaling: how each moment's NVFP4 tensor scale (its amax) is set. "delayed":
            `headroom` times the amax its stored form had at the previous step (the first step
            measures its own), kept in `<moment>_next_amax`, so the fused step needs no pass
            to find it first. A stored moment that grows more than that in one step saturates
            its largest blocks for that step: m / sqrt(v) then makes a smaller step, and a v
            read back smaller is bounded by m being stored over its root. "current": the amax
            of the stored form itself, a global reduction before each quantization.
        headroom: delayed scaling's factor (>= 1; a power of two keeps the products exact).
        min_numel: tensors smaller than this keep fp32 states.
        seed: base seed of the stochastic rounding.
        fused: run the quantized states of a group in one fused Triton step
            (fp4stack/kernels/adamw4.py), bit-exact with the step here. None: when the group has
            the default transform, state_rounding, first_moment and scaling, Triton is
            installed, and the parameter is float32 and on CUDA; other parameters take the step
            here. True: require it (a ValueError says why not; on the CPU it runs under
            TRITON_INTERPRET=1, for tests). False: never. The state_dict is the same either way,
            so a run may switch.
        cuda_graphs: on CUDA, the fused step captures its launches as a CUDA graph (at its
            third step with the same tensors) and replays it, which spares the launches' host
            time (the same kernels: the same bits). A step called inside another CUDA graph
            capture is an error.
    All options but `fused` and `cuda_graphs` may differ per param group; a parameter's state
    layout is fixed at its first step. maximize, amsgrad and foreach are not implemented (a
    ValueError if set).
    The fused step rewrites the states in place; between steps it holds, besides them, its
    launch tables (~200 bytes per tensor and 4 per 1024 elements), float64 row, column and total
    sums of v and float32 roots and reciprocal roots of its factors (16 bytes per row and per
    column), none of them counted by `state_bytes` nor saved.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        transform: str = DEFAULT_TRANSFORM,
        state_rounding: str = DEFAULT_ROUNDING,
        first_moment: str = DEFAULT_FIRST_MOMENT,
        scaling: str = DEFAULT_SCALING,
        headroom: float = DEFAULT_HEADROOM,
        min_numel: int = 4096,
        seed: int = 0,
        maximize: bool = False,
        amsgrad: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        cuda_graphs: bool = True,
    ) -> None:
        for name, flag in (("maximize", maximize), ("amsgrad", amsgrad), ("foreach", foreach)):
            if flag:
                raise ValueError(f"AdamW4 does not implement {name}={flag!r}")
        if fused not in (None, True, False):
            raise ValueError(f"fused must be None, True or False, got {fused!r}")
        # Set before super().__init__, which adds the groups (and checks them).
        self.fused = fused
        self.cuda_graphs = cuda_graphs
        self._reset_fused()
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        transform=transform, state_rounding=state_rounding,
                        first_moment=first_moment, scaling=scaling, headroom=headroom,
                        min_numel=min_numel, seed=seed)
        super().__init__(params, defaults)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "fused": self.fused, "cuda_graphs": self.cuda_graphs}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Pickling keeps the options but not the fused step's device tables and graphs.
        super().__setstate__(state)
        self.__dict__.setdefault("fused", None)
        self.__dict__.setdefault("cuda_graphs", True)
        self._reset_fused()

    def _reset_fused(self) -> None:
        """Forget the fused step's plans (device tables, buffers, CUDA graphs) and caches."""
        self._plans: dict = {}
        self._step_views: dict = {}
        self._fusable_ids: set[int] = set()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _check_group({**self.defaults, **param_group})
        if self.fused:
            reason = _unfusable_group({**self.defaults, **param_group})
            if reason:
                raise ValueError(f"AdamW4(fused=True): {reason}")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step; params without a gradient are skipped."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # A parameter's index in the flattened groups is part of its SR seed: stable across a
        # state_dict round trip, so a reloaded run draws the same bits.
        index = 0
        for group in self.param_groups:
            fused = self.fused is not False and not _unfusable_group(group)
            on_cpu = bool(self.fused) and _interpreted()  # the kernel under the interpreter
            batch, fp32 = [], []
            for p in group["params"]:
                grad = p.grad
                if grad is not None:
                    if fused and (self._still_fusable(p, grad)
                                  or self._fusable(p, group, on_cpu)):
                        batch.append((p, index))
                    elif self._fp32_batchable(p, group):
                        fp32.append(p)
                    else:
                        self._step_param(p, group, index)
                index += 1
            if batch:
                self._fused_step(batch, group)
            if fp32:
                self._fp32_step(fp32, group)
        return loss

    def _still_fusable(self, p: Tensor, grad: Tensor) -> bool:
        """For a parameter `_fusable` accepted before, the checks that can change from step to
        step (~0.5 us a parameter, against ~1 us for all of them). The parameter's own storage
        is part of the fused step's plan key: a plan for a new one checks it again."""
        return (id(p) in self._fusable_ids and grad.dtype is torch.float32
                and grad.layout is torch.strided and grad.is_contiguous()
                and not grad.data_ptr() & 15)

    def _fp32_batchable(self, p: Tensor, group: dict[str, Any]) -> bool:
        """Whether p (with a gradient) keeps fp32 states and takes the batched fp32 step: a
        float32 parameter with a dense float32 gradient."""
        state = self.state[p]
        if state:
            if "exp_avg" not in state:
                return False
        elif not (group["transform"] == _NONE or keeps_fp32_state(p, group["min_numel"])):
            return False
        grad = p.grad
        return (p.dtype == torch.float32 and grad.dtype == torch.float32
                and grad.layout == torch.strided)

    def _fp32_step(self, params: list[Tensor], group: dict[str, Any]) -> None:
        """The fp32-state parameters of a group in one set of multi-tensor (foreach) ops, those
        of torch.optim.AdamW(foreach=True) in its order: one launch per op for all of them on
        CUDA, instead of several per parameter."""
        states = []
        for p in params:
            state = self.state[p]
            if not state:
                self._init_state(p, group, state)
            states.append(state)
        adamw_update_foreach(
            params, [p.grad for p in params], [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states], self._count_steps(states), group["lr"],
            *group["betas"], group["eps"], group["weight_decay"])

    def _fusable(self, p: Tensor, group: dict[str, Any], on_cpu: bool) -> bool:
        """Whether p (with a gradient, in a fusable group) takes the fused step: quantized
        states, float32, contiguous and 16-byte aligned, on CUDA (or on the CPU under the
        Triton interpreter with fused=True). With fused=True, a quantized parameter that cannot
        is an error."""
        state = self.state[p]
        if "exp_avg" in state or (not state and keeps_fp32_state(p, group["min_numel"])):
            return False
        grad = p.grad
        reason = None
        if not (p.is_cuda or on_cpu):
            reason = f"a parameter is on {p.device} (CUDA, or TRITON_INTERPRET=1 on the CPU)"
        elif p.dtype != torch.float32 or grad.dtype != torch.float32 or grad.is_sparse:
            reason = f"needs float32 parameters and dense gradients, got {p.dtype} / {grad.dtype}"
        elif not (p.is_contiguous() and grad.is_contiguous()):
            reason = "needs contiguous parameters and gradients"
        elif p.data_ptr() % 16 or grad.data_ptr() % 16 or p.numel() >= 2**31:
            reason = "needs 16-byte aligned parameters and gradients of < 2**31 elements"
        if reason is None:
            self._fusable_ids.add(id(p))
            return True
        if self.fused:
            raise ValueError(f"AdamW4(fused=True): {reason}")
        return False

    def _fused_step(self, batch: list[tuple[Tensor, int]], group: dict[str, Any]) -> None:
        from ..kernels.adamw4_step import fused_step

        states = []
        for p, _ in batch:
            state = self.state[p]
            if not state:
                self._init_state(p, group, state)
            states.append(state)
        # Launched together only with the same step count (the bias corrections and seeds are
        # per launch): normally all of them.
        by_step: dict[int, list[int]] = {}
        for i, v in enumerate(self._count_steps(states)):
            by_step.setdefault(int(v), []).append(i)
        beta1, beta2 = group["betas"]
        for step, members in by_step.items():
            params = [batch[i][0] for i in members]
            fused_step(
                params, [p.grad for p in params], [states[i] for i in members],
                [batch[i][1] for i in members], step, lr=group["lr"], beta1=beta1,
                beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                headroom=float(group["headroom"]), seed=group["seed"], cache=self._plans,
                graphs=self.cuda_graphs,
            )

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
        grad = p.grad
        if grad.is_sparse:
            raise RuntimeError(
                "AdamW4 does not support sparse gradients; use torch.optim.SparseAdam"
            )
        if torch.is_complex(p):
            raise RuntimeError("AdamW4 does not support complex parameters")
        state = self.state[p]
        if not state:
            self._init_state(p, group, state)
        state["step"] += 1
        step = float(state["step"].item())

        quantized = "exp_avg_data" in state
        if quantized:
            transform = get_transform(group["transform"])
            exp_avg = dequantize(_nvfp4(state, "exp_avg", p.shape))
            exp_avg_sq, root = _read_v(state, transform, p.shape)
            if group["first_moment"] == "normalized":
                exp_avg = exp_avg * root
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
            self._store_moments(state, group, index, int(step), transform, exp_avg, exp_avg_sq)

    def _store_moments(self, state: dict[str, Tensor], group: dict[str, Any], index: int,
                       step: int, transform: Transform, m: Tensor, v: Tensor) -> None:
        """Quantize the new moments into `state`: v through its transform, then m (normalized:
        over the root of the v the next step reads back, so that m round-trips exactly)."""
        spec = QuantSpec(rounding=group["state_rounding"], nan_policy="propagate")
        normalized = group["first_moment"] == "normalized"
        # Delayed scaling: the amaxes of the previous step's stored moments, times headroom. The
        # first step has none and calibrates on its own: v's stored form, and m over the root
        # of v as it is (the v read back needs v's amax first).
        delayed = group["scaling"] == "delayed"
        headroom = group["headroom"]
        calibrate = delayed and step == 1
        stored_v = _encode_v(state, transform, v)
        amax_v = _amax(stored_v)
        if delayed:
            scale_v = headroom * amax_v if calibrate else state["exp_avg_sq_next_amax"]
            state["exp_avg_sq_next_amax"] = headroom * amax_v
        else:
            scale_v = amax_v
        seed = state_seed(group["seed"], index, step, 1)
        _store(state, "exp_avg_sq", quantize(stored_v, spec=spec, amax=scale_v, seed=seed))

        stored_m = m
        if normalized:
            _, root = _read_v(state, transform, m.shape)
            stored_m = safe_divide(m, root)
        amax_m = _amax(stored_m)
        if delayed:
            if calibrate:
                scale_m = headroom * _amax(safe_divide(m, sqrt_rn(v)) if normalized else m)
            else:
                scale_m = state["exp_avg_next_amax"]
            state["exp_avg_next_amax"] = headroom * amax_m
        else:
            scale_m = amax_m
        seed = state_seed(group["seed"], index, step, 0)
        _store(state, "exp_avg", quantize(stored_m, spec=spec, amax=scale_m, seed=seed))

    def _init_state(self, p: Tensor, group: dict[str, Any], state: dict[str, Tensor]) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        if group["transform"] == _NONE or keeps_fp32_state(p, group["min_numel"]):
            for name in _MOMENTS:
                state[name] = torch.zeros_like(p, dtype=torch.float32,
                                               memory_format=torch.preserve_format)
            return
        zeros = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        _store(state, "exp_avg", quantize(zeros))
        # v = 0 is stored as encode(0), which is not 0 for every transform (rsqrt: 1 / c).
        transform = get_transform(group["transform"])
        _store(state, "exp_avg_sq", quantize(_encode_v(state, transform, zeros)))
        for name in _MOMENTS:  # delayed scaling's amaxes: none seen yet
            state[f"{name}_next_amax"] = torch.zeros((), dtype=torch.float32, device=p.device)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict; NVFP4 fields and fp32 states keep their dtypes.

        torch's loader casts every floating state tensor to its parameter's dtype, which would
        turn the packed uint8 codes into floats (and fp32 states of a bf16 parameter into bf16),
        so the loaded states are put back as saved.
        """
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # saved before these options existed
            group.setdefault("scaling", DEFAULT_SCALING)
            group.setdefault("headroom", DEFAULT_HEADROOM)
        self._reset_fused()
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params, strict=True):
            if pid in state_dict["state"]:
                self.state[p] = {
                    k: v.detach().clone().to(p.device) if isinstance(v, Tensor) else v
                    for k, v in state_dict["state"][pid].items()
                }
                # torch keeps "step" on the CPU unless capturable; so do we.
                self.state[p]["step"] = self.state[p]["step"].cpu()
                _upgrade_state(self.state[p])

    def state_bytes(self) -> int:
        """Bytes held by the states: NVFP4 data, scales and amax, fp32 fallbacks, step counters."""
        return sum(
            v.numel() * v.element_size()
            for s in self.state.values()
            for v in s.values()
            if isinstance(v, Tensor)
        )


def _check_group(group: dict[str, Any]) -> None:
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    if isinstance(lr, Tensor):
        raise ValueError("AdamW4 takes lr as a float (a tensor lr is not supported)")
    if not lr >= 0.0:
        raise ValueError(f"invalid learning rate: {lr}")
    if not eps >= 0.0:
        raise ValueError(f"invalid eps: {eps}")
    if not wd >= 0.0:
        raise ValueError(f"invalid weight_decay: {wd}")
    betas = group["betas"]
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if group["transform"] != _NONE and group["transform"] not in TRANSFORMS:
        raise ValueError(
            f"unknown transform {group['transform']!r}; choose from {[*TRANSFORMS, _NONE]}"
        )
    if group["state_rounding"] not in _ROUNDINGS:
        raise ValueError(
            f"state_rounding must be one of {_ROUNDINGS}, got {group['state_rounding']!r}"
        )
    if group["first_moment"] not in _FIRST_MOMENTS:
        raise ValueError(
            f"first_moment must be one of {_FIRST_MOMENTS}, got {group['first_moment']!r}"
        )
    if group.get("scaling", DEFAULT_SCALING) not in _SCALINGS:
        raise ValueError(f"scaling must be one of {_SCALINGS}, got {group['scaling']!r}")
    headroom = group.get("headroom", DEFAULT_HEADROOM)
    if isinstance(headroom, bool) or not isinstance(headroom, int | float) or not (
            1.0 <= headroom < math.inf):
        raise ValueError(f"headroom must be a finite number >= 1, got {headroom!r}")
    if not isinstance(group["min_numel"], int) or group["min_numel"] < 0:
        raise ValueError(f"min_numel must be an int >= 0, got {group['min_numel']!r}")
    if not isinstance(group["seed"], int) or group["seed"] < 0:
        raise ValueError(f"seed must be an int >= 0, got {group['seed']!r}")


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _unfusable_group(group: dict[str, Any]) -> str | None:
    """Why the fused step cannot run this group's settings, or None."""
    wanted = {"transform": DEFAULT_TRANSFORM, "state_rounding": DEFAULT_ROUNDING,
              "first_moment": DEFAULT_FIRST_MOMENT, "scaling": DEFAULT_SCALING}
    for name, value in wanted.items():
        if group[name] != value:
            return f"the fused step implements only {name}={value!r}, got {group[name]!r}"
    from .. import kernels

    if not kernels.available():
        return "Triton is not installed"
    return None


def _nvfp4(state: dict[str, Tensor], name: str, shape: torch.Size) -> NVFP4Tensor:
    return NVFP4Tensor(
        data=state[f"{name}_data"], scales=state[f"{name}_scales"],
        amax=state[f"{name}_amax"], shape=shape, spec=QuantSpec(),
    )


def _read_v(state: dict[str, Tensor], transform: Transform, shape: torch.Size
            ) -> tuple[Tensor, Tensor]:
    """v as stored in `state`, and its square root (state_transforms.read_state)."""
    factors = None
    if transform.factored:
        factors = (state["exp_avg_sq_row"], state["exp_avg_sq_col"])
    return read_state(_nvfp4(state, "exp_avg_sq", shape), transform, factors)


def _encode_v(state: dict[str, Tensor], transform: Transform, v: Tensor) -> Tensor:
    """The stored form of v; a factored transform's factors go into `state`."""
    stored, factors = encode_state(v, transform)
    if factors is not None:
        state["exp_avg_sq_row"], state["exp_avg_sq_col"] = factors
    return stored


def _upgrade_state(state: dict[str, Tensor]) -> None:
    """A quantized state saved before delayed scaling (no `<moment>_next_amax`; rank-1 factors
    kept as means, not their roots) in the current layout: the factors' roots, and the saved
    amaxes (those of the last stored moments) times the default headroom as the next ones."""
    if "exp_avg_data" not in state or "exp_avg_next_amax" in state:
        return
    if "exp_avg_sq_row" in state:
        for key in ("exp_avg_sq_row", "exp_avg_sq_col"):
            state[key] = state[key].double().sqrt().float()
    for name in _MOMENTS:
        state[f"{name}_next_amax"] = DEFAULT_HEADROOM * state[f"{name}_amax"]


def _amax(x: Tensor) -> Tensor:
    return x.abs().amax() if x.numel() else torch.zeros((), device=x.device)


def _store(state: dict[str, Tensor], name: str, q: NVFP4Tensor) -> None:
    for field in _FIELDS:
        state[f"{name}_{field}"] = getattr(q, field)
