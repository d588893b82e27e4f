"""MoE experts as custom ops over all experts (forward, backward): static shapes to compile.

The per-expert loop (`Experts.loop_forward`) reads each expert's token count on the host to
slice its tokens, which torch.compile cannot trace without a graph break. Here the token-expert
pairs are sorted by expert on the device and one op per projection runs every expert's GEMM on
its own rows; the counts are read inside the op, which torch.compile sees as one node whose
output shape ([pairs, out]) does not depend on the routing. Each expert's GEMMs are the loop's
(`quant_linear`'s numerics: the same operands, quantizations and products), so an RNE recipe
gives the loop's bits. Plain experts (no recipe) run each GEMM as one torch._grouped_mm where
its operands are 16-byte aligned, with no host read of the counts: on the CPU with the loop's
bits, on sm90 in bfloat16 with a grouped kernel's (close to cuBLAS's, not equal). So do
weight-only experts (qat-w: `weight_only`), each expert's quantized weight for its weight.
Stochastic roundings take their seeds from one [E, 6] draw in the forward (one seed per expert
and operand), so the backward draws nothing and a compiled step repeats an eager one bit for bit;
their draws are not the loop's.
"""

from __future__ import annotations

import functools

import torch

from ..api import fake_quantize_stack, stackable
from ..formats.spec import QuantSpec
from ..kernels.expert_order import expert_order
from ..ops import spec_from_key, spec_key
from .operands import _compute_dtype, quantize_operand, quantize_operand_pair, step_operand
from .recipe import Recipe

# The operands of an expert GEMM's recipe, in the order of the seeds' columns.
_OPERANDS = ("x", "w", "dy", "w_dgrad", "x_wgrad", "dy_wgrad")


def recipe_key(recipe: Recipe | None) -> str:
    """The six operand specs of `recipe` as one string for the ops ("-": a backward operand that
    reuses the forward's); None (plain experts) is every operand unquantized."""
    if recipe is None:
        return "plain"
    return ";".join("-" if getattr(recipe, n) is None else spec_key(getattr(recipe, n))
                    for n in _OPERANDS)


@functools.cache
def _specs(key: str) -> dict[str, QuantSpec | None] | None:
    if key == "plain":
        return None
    return {n: None if k == "-" else spec_from_key(k)
            for n, k in zip(_OPERANDS, key.split(";"), strict=True)}


def stochastic(recipe: Recipe | None) -> bool:
    """Whether any operand of `recipe` rounds stochastically (then the ops take seeds)."""
    return recipe is not None and any(
        getattr(recipe, n) is not None and getattr(recipe, n).rounding == "stochastic"
        for n in _OPERANDS)


def _rows(counts: torch.Tensor, host_counts: list[int] | None = None):
    # (expert, row slice) of every expert with rows: the host read the op exists to hide,
    # unless an eager caller has read the counts already (host_counts).
    start = 0
    for e, n in enumerate(counts.tolist() if host_counts is None else host_counts):
        if n:
            yield e, slice(start, start + n)
        start += n


def grouped_mm_runs(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm computes plain experts of `weight` [E, O, K] in `dtype`, all in
    one call per GEMM: its rows must be 16-byte aligned, and on CUDA only bfloat16 on sm90+ has
    a grouped kernel (elsewhere each expert's GEMM is launched on its own)."""
    if (getattr(torch, "_grouped_mm", None) is None or (weight.shape[1] * dtype.itemsize) % 16
            or (weight.shape[2] * dtype.itemsize) % 16):
        return False
    if weight.device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(weight.device) >= (9, 0)
    return weight.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def weight_only(key: str) -> bool:
    """Whether recipe `key` (a `recipe_key`) quantizes only the weights, by RNE, the forward's
    Q(W) reused in dgrad (qat-w): its expert GEMMs are then the plain experts' with Q(W_e) for
    W_e, which torch._grouped_mm runs as one call per GEMM, with no host read of the counts."""
    specs = _specs(key)
    if specs is None:
        return False
    unquantized = all(specs[n] is not None and specs[n].format == "none"
                      for n in ("x", "dy", "dy_wgrad"))
    w = specs["w"]
    return (unquantized and specs["x_wgrad"] is None and specs["w_dgrad"] is None
            and w is not None and w.format != "none" and w.rounding == "rne")


def _stack_in(weight: torch.Tensor, specs: dict | None, dtype: torch.dtype) -> torch.Tensor:
    # The stack the grouped GEMMs multiply, in dtype: W for plain experts; for weight-only ones
    # Q(W_e) of every expert, each with its own global amax, as the loop quantizes them one by
    # one (an expert with no rows too: its GEMM adds nothing). Made once for the forward and
    # the backward of every micro-batch of an update (`weight_operands_once`).
    if specs is None:
        return step_operand(weight, ("cast", dtype), lambda: weight.to(dtype))
    spec = specs["w"]
    if stackable(spec):  # the whole stack in one quantize pass, the loop's bits
        return step_operand(weight, ("experts", spec, dtype),
                            lambda: fake_quantize_stack(weight.detach(), spec, dtype=dtype))
    return step_operand(weight, ("experts", spec, dtype), lambda: torch.stack(
        [quantize_operand(weight[e], spec, dtype=dtype) for e in range(weight.shape[0])]))


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    return counts.cumsum(0, dtype=torch.int32)  # each expert's end row, as _grouped_mm takes them


def _aligned(t: torch.Tensor) -> torch.Tensor:
    # CUDA's _grouped_mm refuses operands whose data does not start on 16 bytes (a view at an
    # offset); its CPU fallback takes them.
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _seed(seeds, e: int, name: str):
    return None if seeds is None else seeds[e, _OPERANDS.index(name)]


def _q(t, spec, seeds, e, name, amax=None, columnwise=False, dtype=None):
    return quantize_operand(t, spec, amax, columnwise=columnwise, dtype=dtype,
                            seed=_seed(seeds, e, name))


def _forward_operands(x, w, specs, x_amax, seeds, e, dtype):
    qw = _q(w, specs["w"], seeds, e, "w", dtype=dtype)
    amax = None if x_amax is None else x_amax[e]
    return _q(x, specs["x"], seeds, e, "x", amax, dtype=dtype), qw


@torch.library.custom_op("fp4stack::grouped_expert_linear", mutates_args=())
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
                   x_amax: torch.Tensor | None, seeds: torch.Tensor | None, recipe: str,
                   dtype: torch.dtype, host_counts: list[int] | None = None) -> torch.Tensor:
    """y [N, O] in `dtype`: rows of x [N, K] sorted by expert, counts[e] of them expert e's,
    each block times weight[e]ᵀ (weight [E, O, K]) with the GEMM of `recipe` (a `recipe_key`);
    x_amax [E] a static activation amax per expert, seeds [E, 6] int64 for stochastic specs;
    host_counts the counts as read on the host already (eager callers), or None."""
    specs = _specs(recipe)
    if (specs is None or weight_only(recipe)) and grouped_mm_runs(weight, dtype):
        w_t = _aligned(_stack_in(weight, specs, dtype)).transpose(-2, -1)
        return torch._grouped_mm(_aligned(x.to(dtype)), w_t, offs=_offsets(counts))
    y = x.new_zeros((x.shape[0], weight.shape[1]), dtype=dtype)
    if specs is None:  # the casts once for all experts: elementwise, so the same values
        x_low, w_low = x.to(dtype), weight.to(dtype)
        for e, rows in _rows(counts, host_counts):
            y[rows] = x_low[rows] @ w_low[e].t()
        return y
    for e, rows in _rows(counts, host_counts):
        qx, qw = _forward_operands(x[rows], weight[e], specs, x_amax, seeds, e, dtype)
        y[rows] = qx @ qw.t()
    return y


@grouped_linear.register_fake
def _(x, weight, counts, x_amax, seeds, recipe, dtype, host_counts=None):
    return x.new_empty((x.shape[0], weight.shape[1]), dtype=dtype)


@torch.library.custom_op("fp4stack::grouped_expert_linear_backward", mutates_args=())
def grouped_linear_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                            counts: torch.Tensor, x_amax: torch.Tensor | None,
                            seeds: torch.Tensor | None, recipe: str, dtype: torch.dtype,
                            host_counts: list[int] | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [N, K] in x's dtype, dweight [E, O, K] in weight's): `_QuantLinearFn.backward` per
    expert, its saved operands re-quantized from x and weight with the forward's seeds."""
    specs = _specs(recipe)
    if ((specs is None or (weight_only(recipe) and dy.dtype == dtype))
            and grouped_mm_runs(weight, dy.dtype)):
        # autograd's formulas for F.linear with the loop's operands (dy as it is, x and W, or
        # the forward's Q(W), in dy's dtype); dw as xᵀ·dy, the loop's product, transposed
        dy, offs = _aligned(dy.contiguous()), _offsets(counts)  # not expanded strides
        x_low, w_low = _aligned(x.to(dy.dtype)), _aligned(_stack_in(weight, specs, dy.dtype))
        dw = torch._grouped_mm(x_low.t(), dy, offs=offs).transpose(-2, -1)
        return (torch._grouped_mm(dy, w_low, offs=offs).to(x.dtype),
                torch.empty_like(weight).copy_(dw))
    if specs is None:  # autograd's formulas for F.linear, as the plain loop gets them, with the
        # casts once for all experts (elementwise: the same values) and dw in dy's dtype until
        # the end, as each expert's product was cast on its own
        x_low, w_low = x.to(dy.dtype), weight.to(dy.dtype)
        dx, dw_low = torch.zeros_like(x), torch.zeros_like(weight, dtype=dy.dtype)
        for e, rows in _rows(counts, host_counts):
            dye = dy[rows]
            dx[rows] = dye.mm(w_low[e]).to(x.dtype)
            dw_low[e] = x_low[rows].t().mm(dye).t()
        return dx, dw_low.to(weight.dtype)
    dx, dw = torch.zeros_like(x), torch.zeros_like(weight)
    for e, rows in _rows(counts, host_counts):
        xe, we, dye = x[rows], weight[e], dy[rows]
        if specs["x_wgrad"] is None:
            qx, qw = _forward_operands(xe, we, specs, x_amax, seeds, e, dtype)
            xw = qx
        else:  # the seeds are explicit: the pair's order of draws does not matter here
            qw = _q(we, specs["w"], seeds, e, "w", dtype=dtype)
            qx, xw = quantize_operand_pair(
                xe, specs["x"], specs["x_wgrad"], None if x_amax is None else x_amax[e], None,
                dtype, seed=_seed(seeds, e, "x"), seed_t=_seed(seeds, e, "x_wgrad"))
        wd = qw if specs["w_dgrad"] is None else _q(we, specs["w_dgrad"], seeds, e, "w_dgrad",
                                                    columnwise=True, dtype=dtype)
        qdy, dyw = quantize_operand_pair(dye, specs["dy"], specs["dy_wgrad"],
                                         seed=_seed(seeds, e, "dy"),
                                         seed_t=_seed(seeds, e, "dy_wgrad"))
        dx[rows] = (qdy @ wd).to(x.dtype)
        dw[e] = (dyw.t() @ xw).to(weight.dtype)
    return dx, dw


@grouped_linear_backward.register_fake
def _(dy, x, weight, counts, x_amax, seeds, recipe, dtype, host_counts=None):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, counts, x_amax, seeds, recipe, dtype, host_counts = inputs
    ctx.save_for_backward(x, weight, counts, x_amax, seeds)
    ctx.recipe, ctx.dtype, ctx.host_counts = recipe, dtype, host_counts


def _backward(ctx, dy):
    x, weight, counts, x_amax, seeds = ctx.saved_tensors
    dx, dw = grouped_linear_backward(dy, x, weight, counts, x_amax, seeds, ctx.recipe, ctx.dtype,
                                     ctx.host_counts)
    return dx, dw, None, None, None, None, None, None


grouped_linear.register_autograd(_backward, setup_context=_setup_context)


def sort_pairs(indices: torch.Tensor, n_experts: int):
    """(order, counts) for routing indices [T, k]: the T*k pairs sorted by expert (stable, so
    an expert's pairs keep pair order) and each expert's count [E], with static shapes."""
    flat = indices.reshape(-1)
    order = expert_order(flat, n_experts)
    bounds = torch.searchsorted(flat[order], torch.arange(n_experts + 1, device=flat.device))
    return order, bounds[1:] - bounds[:-1]


def combine(y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """out [T, D] fp32 (fp64 stays): each token's k rows of y [T*k, D] (sorted by expert) times
    their routing weights, added from zero in increasing expert order, as the loop's
    index_add_ does, but by gathers: deterministic on every device."""
    dtype = torch.promote_types(y.dtype, torch.float32)
    where = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(),
                                                                    device=order.device))
    pos = where.reshape(-1, k).sort(dim=1).values  # a token's rows, in expert order
    contrib = y * weights.flatten()[order, None].to(dtype)
    out = torch.zeros((pos.shape[0], y.shape[1]), dtype=dtype, device=y.device)
    for j in range(k):
        out = out + contrib[pos[:, j]]
    return out


def grouped_forward(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                    stacks: tuple[torch.Tensor, torch.Tensor], recipe: Recipe | None,
                    x_amax: torch.Tensor | None, act) -> torch.Tensor:
    """sum_j weights[:, j] * expert_j(x) for x [T, D] with SwiGLU experts (gate_up, down
    stacks), the GEMMs of `recipe` (None: unquantized); x_amax [2, E] static amax or None."""
    k, n_experts = indices.shape[1], stacks[0].shape[0]
    order, counts = sort_pairs(indices, n_experts)
    xs = x[order // k]
    key = recipe_key(recipe)
    seeds = (None, None)
    if stochastic(recipe):  # one draw for both projections, in the forward
        seeds = torch.randint(0, 2**62, (2, n_experts, len(_OPERANDS))).unbind(0)
    amax = (None, None) if x_amax is None else x_amax.unbind(0)
    # Eager, the counts are read on the host once for the block's four GEMM ops (forward and
    # backward of both projections), each a device sync otherwise; a compiled graph keeps the
    # read inside the ops, and torch._grouped_mm needs none.
    host = None if torch.compiler.is_compiling() or (
        (recipe is None or weight_only(key)) and grouped_mm_runs(stacks[0], _compute_dtype(xs))
    ) else counts.tolist()
    # Each GEMM in the dtype quant_linear would use (autocast's), its output left in it.
    h = grouped_linear(xs, stacks[0], counts, amax[0], seeds[0], key, _compute_dtype(xs), host)
    gate, up = h.chunk(2, dim=-1)
    a = act(gate) * up
    y = grouped_linear(a, stacks[1], counts, amax[1], seeds[1], key, _compute_dtype(a), host)
    return combine(y, weights, order, k).to(x.dtype)
