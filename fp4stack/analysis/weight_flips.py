"""Weight flips: how often the forward's NVFP4 weights change from one optimizer step to the next,
and how often a change only undoes the one before (oscillation).

A master weight near a rounding boundary can be pushed across it and back by steps that barely
move it, so the forward sees a value jump by a whole E2M1 step while the master weight stays
put; QAT work calls this oscillation, and it is strongest late in training, when the learning
rate is small. Each observation quantizes every QuantLinear's weight with its recipe's forward
spec (the same call the forward makes) and compares, element by element, its value before the
global scale (E2M1 value x E4M3 block scale) with the last two observations; the global scale
is left out, since it moves every weight a little whenever the tensor's amax moves.

    flips = WeightFlips(model)          # takes the first observation
    ... optimizer.step(); flips.observe()
    flips.report()                      # {"weight_flip_rate": ..., "weight_return_rate": ...}

flip rate: fraction of weights whose quantized value differs from the previous observation's.
return rate: fraction whose value differs from the previous one but equals the one before it.
Both are means over the observations since the last report.
"""

from __future__ import annotations

import torch
from torch import nn

from ..api import quantize
from ..formats.e2m1 import code_to_value, unpack
from ..formats.tensor import BLOCK
from ..nn.linear import QuantLinear


def block_values(layer: QuantLinear) -> torch.Tensor:
    """The forward's quantized weight before the global scale: E2M1 value x E4M3 block scale per
    element, exact in bf16 (at most 5 significant bits), so two elements compare equal iff the
    forward multiplies by the same value at a fixed global amax (+0 equals -0)."""
    t = quantize(layer.weight.detach(), spec=layer.recipe.w, amax=layer.shared_weight_amax(),
                 name="weight")
    scales = t.scales.float().repeat_interleave(BLOCK, dim=-1)
    return (code_to_value(unpack(t.data)) * scales).to(torch.bfloat16)


class WeightFlips:
    """Step-to-step flip and return rates of a model's NVFP4 forward weights."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, QuantLinear)
                       and m.weight is not None and m.recipe.w.format == "nvfp4"]
        if not self.layers:
            raise ValueError("WeightFlips: the model has no QuantLinear with an NVFP4 forward "
                             "weight (recipe.w); use a recipe that quantizes the weights")
        self.numel = sum(m.weight.numel() for m in self.layers)
        self._last = [block_values(m) for m in self.layers]
        self._before: list[torch.Tensor] | None = None
        self._reset()

    def _reset(self) -> None:
        self._flips = self._returns = 0.0
        self._count = 0

    @torch.no_grad()
    def observe(self) -> None:
        """Compare the current quantized weights with the last two observations."""
        now = [block_values(m) for m in self.layers]
        counts = torch.zeros(2, dtype=torch.int64, device=now[0].device)  # flips, returns
        for i, key in enumerate(now):
            changed = key != self._last[i]
            counts[0] += changed.sum()
            if self._before is not None:
                counts[1] += (changed & (key == self._before[i])).sum()
        self._before, self._last = self._last, now
        flips, returns = counts.tolist()  # one host sync per step, not one per layer
        self._flips += flips / self.numel
        self._returns += returns / self.numel
        self._count += 1

    def report(self) -> dict[str, float]:
        """Mean flip and return rates since the last report (empty if nothing was observed)."""
        if not self._count:
            return {}
        out = {"weight_flip_rate": self._flips / self._count,
               "weight_return_rate": self._returns / self._count}
        self._reset()
        return out
