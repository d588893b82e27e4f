"""Mixture-of-experts block: a full-precision top-k router, stacked SwiGLU experts, routing replay.

The router is never quantized. Which experts a token goes to is a discrete choice, so a tiny
logit perturbation can send the token to another expert (a "router flip"), and trainer and rollout
then compute different functions. That is a separate, known source of mismatch in MoE RL from the
GEMM quantization error fp4stack works on, so the router computes its logits in fp32 with autocast
off, and routing replay (record the experts one forward chose, force them in another) can remove it
entirely when wanted.

Every expert matmul of the per-expert loop goes through `Experts.expert_linear`, so a subclass
overrides that one method; the sorted path (`grouped_experts`: one op per projection, static
shapes for torch.compile) computes fp4stack's own experts with the loop's numerics, and a
subclass with its own hook keeps the loop.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .grouped_experts import grouped_forward
from .linear import fused_inference_ok


def load_balance_loss(logits: Tensor, indices: Tensor, n_experts: int,
                      real: Tensor | None = None) -> Tensor:
    """Switch/Mixtral auxiliary loss E * sum_e f_e * P_e.

    f_e is the fraction of tokens routed to expert e (counting each of a token's k choices, so the
    f_e sum to k) and P_e the mean router probability of e. This is the normalisation of Hugging
    Face's `load_balancing_loss_func`, so its `router_aux_loss_coef` values carry over; perfectly
    uniform routing gives k. Only P_e carries gradient (to the router). `real` [T] bool counts
    only those tokens (pads are routed but not balanced); none real gives 0.
    """
    probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(dim=-1)
    # Counted by comparison: bincount's output length depends on the data (torch.compile
    # cannot trace it), and a scatter would not be deterministic on CUDA.
    experts = torch.arange(n_experts, device=indices.device)
    chosen = (indices[..., None] == experts).sum(1).to(probs.dtype)  # [T, E]
    if real is None:
        frac = chosen.sum(0) / indices.shape[0]
        return n_experts * (frac * probs.mean(dim=0)).sum()
    # A mask, not the real rows selected: their count would be data-dependent (a host sync,
    # and a graph break under torch.compile).
    w = real.to(probs.dtype)[:, None]
    n = w.sum().clamp(min=1)
    return n_experts * ((chosen * w).sum(0) / n * ((probs * w).sum(0) / n)).sum()


class Router(nn.Module):
    """Top-k softmax router; `gate` is a plain bias-free linear, always run in fp32."""

    def __init__(self, dim: int, n_experts: int, top_k: int, norm_topk_prob: bool = True):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be in [1, n_experts={n_experts}]")
        self.n_experts, self.top_k, self.norm_topk_prob = n_experts, top_k, norm_topk_prob
        self.gate = nn.Linear(dim, n_experts, bias=False)

    def forward(self, x: Tensor, indices: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """x [T, D] -> (weights [T, k], indices [T, k], logits [T, E]), weights and logits fp32.

        With `indices` given (routing replay) those experts are used instead of the top-k, and
        their weights come from this router's own probabilities, gathered there and renormalised,
        so the router still gets gradient.
        """
        # Autocast off and fp32 (or fp64) operands: a bf16 GEMM here would flip routes.
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.to(dtype), self.gate.weight.to(dtype))
        probs = logits.softmax(dim=-1)
        if indices is None:
            weights, indices = probs.topk(self.top_k, dim=-1)
        else:
            weights = probs.gather(-1, indices)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, indices, logits


class Experts(nn.Module):
    """E SwiGLU experts as stacked parameters, in the layout of transformers 5.x fused experts.

    gate_up_proj [E, 2*I, D]: rows [:I] are the gate, rows [I:] the up projection (Qwen3-MoE,
    OLMoE and Mixtral in transformers 5.x: `linear(x, gate_up_proj[e]).chunk(2, dim=-1)` gives
    (gate, up)); down_proj [E, D, I]. Each expert computes down(silu(gate(x)) * up(x)).
    """

    def __init__(self, dim: int, hidden: int, n_experts: int):
        super().__init__()
        self.n_experts, self.dim, self.hidden = n_experts, dim, hidden
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default scale per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        nn.init.uniform_(self.gate_up_proj, -self.dim**-0.5, self.dim**-0.5)
        nn.init.uniform_(self.down_proj, -self.hidden**-0.5, self.hidden**-0.5)

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, dim={self.dim}, hidden={self.hidden}"

    def expert_linear(self, x: Tensor, expert: int, which: str) -> Tensor:
        """The one place expert GEMMs happen: x @ W[expert]^T for which in {"gate_up", "down"}."""
        if which == "gate_up":
            return F.linear(x, self.gate_up_proj[expert])
        if which == "down":
            return F.linear(x, self.down_proj[expert])
        raise ValueError(f"which must be 'gate_up' or 'down', got {which!r}")

    def grouped_operands(self, dtype: torch.dtype | None = None) -> tuple | None:
        """(gate_up, down, x_spec, compensation) for the grouped kernels
        (`kernels.moe_align.grouped_mlp`) on activations of `dtype`, or None where only the
        per-expert loop computes this module's experts."""
        return self.gate_up_proj, self.down_proj, None, None

    def sorted_operands(self) -> tuple | None:
        """((gate_up, down) stacks, recipe, static x_amax [2, E] or None) for the sorted path
        (`grouped_experts.grouped_forward`), or None where only the loop computes the experts.
        Plain experts: the parameters, no recipe; a subclass with its own `expert_linear`
        gets the loop, the one caller of that hook."""
        if type(self).expert_linear is not Experts.expert_linear:
            return None
        return (self.gate_up_proj, self.down_proj), None, None

    def forward(self, x: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        """x [T, D], routing weights and indices [T, k] -> sum_j weights[:, j] * expert_j(x).

        Without gradients on CUDA, all experts run in two grouped launches with no host sync
        (`kernels.moe_align.grouped_mlp`, as the custom op `inference_ops.grouped_mlp`; QUADS's
        compensation of packed experts included). Otherwise the pairs are sorted by expert and
        one op per projection runs every expert's GEMMs (`grouped_experts`: static shapes, so
        torch.compile traces it whole); the loop, their reference, serves what they do not
        (calibration; compensation and packed weights off the grouped path)."""
        if fused_inference_ok(x, self, weights):
            operands = self.grouped_operands(x.dtype)
            if operands is not None:
                from .inference_ops import grouped_mlp

                gate_up, down, x_spec, compensation = operands
                dtype = (torch.get_autocast_dtype(x.device.type)
                         if torch.is_autocast_enabled(x.device.type) else x.dtype)
                return grouped_mlp(x, weights, indices, gate_up, down, x_spec, dtype,
                                   compensation).to(x.dtype)
        operands = self.sorted_operands()
        if operands is not None:
            return grouped_forward(x, weights, indices, *operands, act=F.silu)
        return self.loop_forward(x, weights, indices)

    def loop_forward(self, x: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        """The reference: each expert's GEMMs on its own tokens through `expert_linear`, the k
        outputs of a token summed in float32 in increasing expert order."""
        k = indices.shape[1]
        flat = indices.flatten()
        order = flat.argsort(stable=True)  # token slots grouped by expert
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        tokens = order // k
        x_sorted, w_sorted = x[tokens], weights.flatten()[order]
        # fp32 accumulation (fp64 stays fp64): each token sums k expert outputs.
        out = torch.zeros(x.shape, dtype=torch.promote_types(x.dtype, torch.float32),
                          device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = slice(start, start + n)
            start += n
            gate, up = self.expert_linear(x_sorted[rows], e, "gate_up").chunk(2, dim=-1)
            y = self.expert_linear(F.silu(gate) * up, e, "down")
            # A token picks distinct experts, so each index_add_ sees each row once: deterministic.
            out.index_add_(0, tokens[rows], y * w_sorted[rows, None].to(out.dtype))
        return out.to(x.dtype)


class KeepsAuxLoss(nn.Module):
    """A module that leaves its last forward's aux loss in `aux_loss`: that tensor hangs on the
    forward's graph, so it is not state. Copies and pickles get None instead (deepcopy refuses
    non-leaf tensors, and a pickle would drag the graph along)."""

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "aux_loss": None}


class MoEBlock(KeepsAuxLoss):
    """Router + Experts. forward(x [..., D]) -> y [..., D]; the aux loss is left in `aux_loss`.

    Routing replay: set `replay_indices` (shape [..., k] matching x's leading dims, e.g. from
    `record_routing`) to force those experts; `None` routes normally.
    """

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int,
                 norm_topk_prob: bool = True):
        super().__init__()
        self.router = Router(dim, n_experts, top_k, norm_topk_prob)
        self.experts = Experts(dim, hidden, n_experts)
        self.aux_loss: Tensor | None = None
        self.replay_indices: Tensor | None = None
        self._recorded: list[Tensor] | None = None  # a list while record_routing is active

    def forward(self, x: Tensor, real: Tensor | None = None) -> Tensor:
        """x [..., D] -> y [..., D]; real (x's leading shape, bool): the tokens the aux loss
        balances (None: all; pads are routed all the same)."""
        lead, k = x.shape[:-1], self.router.top_k
        flat = x.reshape(-1, x.shape[-1])
        forced = None
        if self.replay_indices is not None:
            if self.replay_indices.shape != (*lead, k):
                raise ValueError(f"replay_indices has shape {tuple(self.replay_indices.shape)}, "
                                 f"this forward needs {(*lead, k)}")
            forced = self.replay_indices.reshape(-1, k).to(x.device, torch.long)
        weights, indices, logits = self.router(flat, forced)
        # Only training needs the aux loss: inference (grad mode off) leaves None.
        self.aux_loss = (load_balance_loss(logits, indices, self.router.n_experts,
                                           None if real is None else real.reshape(-1))
                         if torch.is_grad_enabled() else None)
        if self._recorded is not None:
            self._recorded.append(indices.detach().reshape(*lead, k))
        return self.experts(flat, weights, indices).reshape(x.shape)


def _moe_blocks(model: nn.Module) -> dict[str, MoEBlock]:
    return {name: m for name, m in model.named_modules() if isinstance(m, MoEBlock)}


@contextmanager
def record_routing(model: nn.Module) -> Iterator[dict[str, Tensor]]:
    """Record the experts every MoEBlock in `model` chooses.

    Yields a dict that is filled when the `with` block exits: module name -> indices [B, S, k].
    Several forwards inside one recording are taken to be consecutive chunks of the same sequences
    and are concatenated along the sequence dimension, so a prefill plus single-token decode steps
    record the routing of the whole generated sequence (bar the last sampled token).
    """
    blocks = _moe_blocks(model)
    routing: dict[str, Tensor] = {}
    for block in blocks.values():
        block._recorded = []
    try:
        yield routing
    finally:
        for name, block in blocks.items():
            chunks, block._recorded = block._recorded, None
            if chunks:
                routing[name] = torch.cat(chunks, dim=-2)  # the sequence (or token) dim


@contextmanager
def replay_routing(model: nn.Module, routing: Mapping[str, Tensor]) -> Iterator[None]:
    """Force every MoEBlock in `model` to use the experts in `routing` (as from record_routing)."""
    blocks = _moe_blocks(model)
    if set(routing) != set(blocks):
        missing, extra = sorted(set(blocks) - set(routing)), sorted(set(routing) - set(blocks))
        raise ValueError(f"routing must name every MoE block: missing {missing}, unknown {extra}")
    for name, block in blocks.items():
        block.replay_indices = routing[name]
    try:
        yield
    finally:
        for block in blocks.values():
            block.replay_indices = None
