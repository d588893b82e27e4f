"""QUADS activation residual compensation: correct the channels with the largest residual energy.

    y = Q(x) Q(W)ᵀ + (x - Q(x))[:, C] Q(W)[:, C]ᵀ

With C = every channel this is x Q(W)ᵀ, the trainer's (weight-only quantized) forward.
"""

from __future__ import annotations

import torch


def channel_energy(residual: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """Per input channel c: sum_t residual[t, c]^2 * ||Q(W)[:, c]||^2 (its share of output error
    energy, ignoring cross terms)."""
    return energy_with_norms(residual, qweight.pow(2).sum(0))


def energy_with_norms(residual: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """channel_energy given the column norms ||Q(W)[:, c]||² (cached by packed layers)."""
    return residual.pow(2).sum(0) * norms


def top_channels(residual: torch.Tensor, qweight: torch.Tensor, k: int) -> torch.Tensor:
    """The k channels of highest residual energy in this batch (sorted indices)."""
    energy = channel_energy(residual.detach().float(), qweight.detach().float())
    return top_indices(energy, k)


def top_indices(energy: torch.Tensor, k: int) -> torch.Tensor:
    """The indices (ascending) of the k largest entries of energy [K], ties at the k-th taken
    lowest index first: the first k of a stable descending sort. A defined tie rule, so the
    fused decoding path (kernels.top_mask) picks the same channels."""
    return torch.sort(energy, descending=True, stable=True).indices[:k].sort().values


def correction(residual: torch.Tensor, qweight: torch.Tensor, channels: torch.Tensor):
    """(x - Q(x))[:, C] Q(W)[:, C]ᵀ."""
    return residual[:, channels] @ qweight[:, channels].t()


def channels_mask(channels: torch.Tensor, k: int) -> torch.Tensor:
    """bool [..., k], True at each row's channels (indices [..., n], distinct within a row): the
    keep mask of static compensation. A comparison, no scatter (which deterministic mode refuses
    on CUDA) and no host sync."""
    cols = torch.arange(k, device=channels.device)
    return (channels.long().unsqueeze(-1) == cols).any(-2)
