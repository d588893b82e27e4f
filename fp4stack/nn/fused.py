"""Fused projections: sibling linear layers that an inference engine runs as one GEMM.

vLLM (its packed_modules_mapping) and the other engines concatenate q/k/v and gate/up weights and
quantize the result with one global scale, so the siblings must share one global amax: the max
over the group of each member's own. Conversion, the compressed-tensors export and the weight sync
all take the groups and the rule from here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# Names of the sibling projections of one block that are fused (and so share a global amax).
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))


def shared_amax(weights: Iterable[torch.Tensor]) -> torch.Tensor:
    """The global amax a fused group's weights are quantized with: max |w| over all of them, as
    a float32 0-d tensor."""
    return torch.stack([w.detach().abs().amax().float() for w in weights]).amax()
