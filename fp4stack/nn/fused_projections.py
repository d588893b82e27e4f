"""Sibling projections of one input (q/k/v, gate/up) run as one GEMM at inference.

A decoding step at a small batch is bound by launches and by the latency of small GEMMs (k and
v of a GQA block are a few hundred kB each): one GEMM over the siblings' rows side by side
reads the same bytes in one launch and, for W4A4, quantizes the shared input once instead of
once per sibling. `fuse_projections(model)` re-lays each group's weights as row slices of one
tensor, so the members keep their own (now view) parameters or packed buffers, a weight sync
that copies into them writes the fused tensor, and nothing is held twice. Blocks call
`project(x, *members)`, which runs the fused GEMM when the group applies and each member
otherwise (training, calibration, CPU reference paths).

The values are the unfused ones: the same Q(x) (the siblings see one input, so one activation
amax), and the same Q(W) rows, since the siblings of a packed group share one global amax
(`nn.fused`). Only the GEMM's summation order may differ (a wider N can pick another tile or
split-K), as it may between any two GEMM shapes. Groups fuse when every member is a bias-free
`nn.Linear` (BF16 engines), or a packed `QuantLinear` of one recipe without a low-rank branch
or static activation amax, packed with one shared global amax (as conversion packs q/k/v and
gate/up); otherwise they stay as they are.

QUADS's residual compensation fuses too: each member has its own channels (picked by its own
weight's column norms, or calibrated: static mode), so the fused GEMM reads one x~ per member
(`kernels.compensation` builds them from one Q(x)), each for its own rows of the weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..formats.tensor import NVFP4Tensor
from .fused import FUSED_GROUPS
from .inference_linear import (
    _propagating,
    compensated_siblings_linear,
    fused_inference_ok,
    packed_inference_linear,
)
from .linear import QuantLinear


@dataclass(eq=False)
class FusedProjection:
    """The members of one group and the tensors their weights are row slices of."""

    members: tuple[nn.Module, ...]
    sizes: tuple[int, ...]
    weight: Tensor | None = None   # [sum N, K]: plain nn.Linear members
    data: Tensor | None = None     # [sum N, K/2] packed codes: QuantLinear members
    scales: Tensor | None = None   # [sum N, K/16] E4M3 block scales

    def _views(self) -> list[Tensor]:
        if self.weight is not None:
            return [m.weight for m in self.members]
        return [t for m in self.members for t in (m.weight_data, m.weight_scales)]

    def __post_init__(self) -> None:
        self._addresses = [t.data_ptr() for t in self._views()]

    def intact(self) -> bool:
        """Whether the members' weights are still the fused tensor's slices (`module.to()` or
        a load that replaces a tensor breaks that: the members then run on their own)."""
        return [t.data_ptr() for t in self._views()] == self._addresses

    def applies(self, x: Tensor) -> bool:
        """Whether the fused GEMM computes this call (else each member runs on its own)."""
        first = self.members[0]
        if not torch.compiler.is_compiling() and not self.intact():
            return False
        if self.weight is not None:
            return not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
        return (all(m._calibration is None for m in self.members)
                and fused_inference_ok(x, first))

    def __call__(self, x: Tensor) -> tuple[Tensor, ...]:
        if self.weight is not None:
            y = F.linear(x, self.weight)
        else:
            first = self.members[0]
            shape = torch.Size((self.data.shape[0], first.in_features))
            weight = NVFP4Tensor(self.data, self.scales, first.weight_global_amax, shape,
                                 first.packed_spec)
            x2 = x.reshape(-1, x.shape[-1])
            if first.recipe.compensation is not None:
                y = compensated_siblings_linear(x2, self.members, weight, self.sizes)
            else:
                y = packed_inference_linear(x2, first.recipe, weight)
            y = y.reshape(*x.shape[:-1], -1)
        return y.split(self.sizes, dim=-1)


def project(x: Tensor, *members: nn.Module) -> tuple[Tensor, ...]:
    """(member(x) for each member), as one GEMM when `fuse_projections` fused them."""
    fused = getattr(members[0], "fused_projection", None)
    if fused is not None and fused.members == members and fused.applies(x):
        return fused(x)
    return tuple(m(x) for m in members)


def _plain(members: tuple[nn.Module, ...]) -> bool:
    return all(type(m) is nn.Linear and m.bias is None for m in members) and len(
        {(m.in_features, m.weight.dtype, m.weight.device) for m in members}) == 1


def _packed(members: tuple[nn.Module, ...]) -> bool:
    if not all(isinstance(m, QuantLinear) and m.weight is None and m.bias is None
               for m in members):
        return False
    first = members[0]
    r = first.recipe
    # Packed with one imposed global amax (conversion's shared-amax groups; a weight sync
    # sends the group's amax to each member), so the rows side by side are one tensor's.
    return (all(m.recipe == r and m.packed_spec == first.packed_spec for m in members)
            and _compensation_fuses(r, first.in_features)
            and r.lowrank is None and r.activation_amax != "static"
            and all(m.weight_amax is not None for m in members)
            and all(torch.equal(m.weight_global_amax, first.weight_global_amax)
                    for m in members))


def _compensation_fuses(r, k: int) -> bool:
    # Compensation through the operand kernels: an x~ per member (its own channels).
    if r.compensation is None:
        return True
    from .. import kernels

    if not kernels.available():
        return False
    from ..kernels.compensation import operand_supported

    return operand_supported(_propagating(r.x), k)


@torch.no_grad()
def _fuse(members: tuple[nn.Module, ...]) -> FusedProjection | None:
    sizes = tuple(m.out_features for m in members)
    if _plain(members):
        weight = torch.cat([m.weight for m in members])
        for m, w in zip(members, weight.split(sizes), strict=True):
            m.weight = nn.Parameter(w, requires_grad=m.weight.requires_grad)
        return FusedProjection(members, sizes, weight=weight)
    if _packed(members):
        data = torch.cat([m.weight_data for m in members])
        scales = torch.cat([m.weight_scales for m in members])
        for m, d, s in zip(members, data.split(sizes), scales.split(sizes), strict=True):
            m.register_buffer("weight_data", d)
            m.register_buffer("weight_scales", s)
        return FusedProjection(members, sizes, data=data, scales=scales)
    return None


def fuse_projections(model: nn.Module) -> int:
    """Re-lay every fusable q/k/v and gate/up group of `model` in place (see the module doc);
    returns how many groups were fused. For an inference copy: a model being trained keeps
    its layout."""
    fused = 0
    for module in model.modules():
        for names in FUSED_GROUPS:
            members = tuple(getattr(module, n, None) for n in names)
            if any(m is None for m in members) or getattr(members[0], "fused_projection", None):
                continue
            group = _fuse(members)
            if group is not None:
                for m in members:
                    m.fused_projection = group
                fused += 1
    return fused
