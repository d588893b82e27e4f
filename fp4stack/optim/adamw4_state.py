"""The per-parameter state of AdamW4 and the reference step's reading and writing of it.

A quantized moment is an NVFP4 tensor kept as three state tensors `<moment>_data` (uint8, two
E2M1 codes per byte), `<moment>_scales` (float8_e4m3fn, one per 1x16 block) and `<moment>_amax`
(fp32 0-d), plus `<moment>_next_amax` (delayed scaling's amax for the next step); a
transform's side factors are `exp_avg_sq_<side>`: a factored one's fp32 roots of v's rank-1
factors, `exp_avg_sq_row` and `exp_avg_sq_col`, a centered one's fp32 mean, `exp_avg_sq_mean`.
Tensors that keep fp32 states hold `exp_avg` and `exp_avg_sq` instead. The fused step
(kernels/adamw4.py) rewrites the same fields in place, bit for bit as `store_moments` does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..api import dequantize, quantize
from ..formats.random import lowbias32_int
from ..formats.spec import QuantSpec
from ..formats.tensor import BLOCK, NVFP4Tensor
from .state_format import DEFAULT_FORMAT, StateFormat
from .state_transforms import (
    Transform,
    encode_state,
    get_transform,
    read_state,
    safe_divide,
    sqrt_rn,
)

# The NVFP4 fields of a quantized moment, kept as separate state tensors.
_FIELDS = ("data", "scales", "amax")
MOMENTS = ("exp_avg", "exp_avg_sq")


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


def init_state(p: Tensor, fmt: StateFormat, min_numel: int, state: dict[str, Tensor]) -> None:
    """Fresh states of `p`: m = v = 0, fp32 or quantized by the fallback rule and `fmt`."""
    state["step"] = torch.tensor(0.0, dtype=torch.float32)
    if not fmt.quantized or keeps_fp32_state(p, min_numel):
        for name in MOMENTS:
            state[name] = torch.zeros_like(p, dtype=torch.float32,
                                           memory_format=torch.preserve_format)
        return
    zeros = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    _store(state, "exp_avg", quantize(zeros))
    # v = 0 is stored as encode(0), which is not 0 for every transform (rsqrt: 1 / c).
    transform = get_transform(fmt.transform)
    _store(state, "exp_avg_sq", quantize(_encode_v(state, transform, zeros)))
    for name in MOMENTS:  # delayed scaling's amaxes: none seen yet
        state[f"{name}_next_amax"] = torch.zeros((), dtype=torch.float32, device=p.device)


def read_moments(state: dict[str, Tensor], fmt: StateFormat, shape: torch.Size
                 ) -> tuple[Tensor, Tensor]:
    """m and v (fp32) from a quantized state: v read back through its transform, m times the
    root of that v when stored normalized."""
    exp_avg = dequantize(_nvfp4(state, "exp_avg", shape))
    exp_avg_sq, root = read_v(state, get_transform(fmt.transform), shape)
    if fmt.first_moment == "normalized":
        exp_avg = exp_avg * root
    return exp_avg, exp_avg_sq


def store_moments(state: dict[str, Tensor], fmt: StateFormat, seed: int, index: int, step: int,
                  m: Tensor, v: Tensor) -> None:
    """Quantize the new moments into `state`: v through its transform, then m (normalized:
    over the root of the v the next step reads back, so that m round-trips exactly)."""
    transform = get_transform(fmt.transform)
    spec = QuantSpec(rounding=fmt.rounding, nan_policy="propagate")
    normalized = fmt.first_moment == "normalized"
    # Delayed scaling: the amaxes of the previous step's stored moments, times headroom. The
    # first step has none and calibrates on its own: v's stored form, and m over the root
    # of v as it is (the v read back needs v's amax first).
    delayed = fmt.scaling == "delayed"
    headroom = fmt.headroom
    calibrate = delayed and step == 1
    stored_v = _encode_v(state, transform, v)
    amax_v = _amax(stored_v)
    if delayed:
        scale_v = headroom * amax_v if calibrate else state["exp_avg_sq_next_amax"]
        state["exp_avg_sq_next_amax"] = headroom * amax_v
    else:
        scale_v = amax_v
    q_seed = state_seed(seed, index, step, 1)
    _store(state, "exp_avg_sq", quantize(stored_v, spec=spec, amax=scale_v, seed=q_seed))

    stored_m = m
    if normalized:
        _, root = read_v(state, transform, m.shape)
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
    q_seed = state_seed(seed, index, step, 0)
    _store(state, "exp_avg", quantize(stored_m, spec=spec, amax=scale_m, seed=q_seed))


def read_v(state: dict[str, Tensor], transform: Transform, shape: torch.Size
           ) -> tuple[Tensor, Tensor]:
    """v as stored in `state`, and its square root (state_transforms.read_state)."""
    factors = tuple(state[f"exp_avg_sq_{side}"] for side in transform.side) or None
    return read_state(_nvfp4(state, "exp_avg_sq", shape), transform, factors)


def upgrade_state(state: dict[str, Tensor]) -> None:
    """A quantized state saved before delayed scaling (no `<moment>_next_amax`; rank-1 factors
    kept as means, not their roots) in the current layout: the factors' roots, and the saved
    amaxes (those of the last stored moments) times the default headroom as the next ones."""
    if "exp_avg_data" not in state or "exp_avg_next_amax" in state:
        return
    if "exp_avg_sq_row" in state:
        for key in ("exp_avg_sq_row", "exp_avg_sq_col"):
            state[key] = state[key].double().sqrt().float()
    for name in MOMENTS:
        state[f"{name}_next_amax"] = DEFAULT_FORMAT.headroom * state[f"{name}_amax"]


def _nvfp4(state: dict[str, Tensor], name: str, shape: torch.Size) -> NVFP4Tensor:
    return NVFP4Tensor(
        data=state[f"{name}_data"], scales=state[f"{name}_scales"],
        amax=state[f"{name}_amax"], shape=shape, spec=QuantSpec(),
    )


def _encode_v(state: dict[str, Tensor], transform: Transform, v: Tensor) -> Tensor:
    """The stored form of v; a transform's side factors go into `state`."""
    stored, factors = encode_state(v, transform)
    for side, factor in zip(transform.side, factors or (), strict=True):
        state[f"exp_avg_sq_{side}"] = factor
    return stored


def _amax(x: Tensor) -> Tensor:
    return x.abs().amax() if x.numel() else torch.zeros((), device=x.device)


def _store(state: dict[str, Tensor], name: str, q: NVFP4Tensor) -> None:
    for field in _FIELDS:
        state[f"{name}_{field}"] = getattr(q, field)
