"""Sparse upcycling: turn a dense SwiGLU model into a mixture of experts that starts as the same
function.

Every expert starts as a copy of the dense MLP. The router's top-k weights are renormalised to sum
to 1, so whatever the router picks, the block outputs the dense MLP's output: the upcycled model's
logits equal the dense model's to rounding. The router starts small and random (seeded):

- small, so its probabilities start near uniform and no expert is favoured;
- random, not zero, because zero logits tie and every token would then go to the same k experts,
  leaving the others without gradient, so the copies would never diverge.

The default std 0.02 is GPTConfig.init_std and Hugging Face's usual initializer_range, the scale a
router trained from scratch starts at.

While the experts are identical the LM loss gives the router no gradient (its choice changes
nothing); the load-balance aux loss does, and the experts diverge as they see different tokens.
`expert_noise` > 0 perturbs each copy (W * (1 + noise * N(0, 1)), seeded) to break the symmetry at
once, at the price of starting only close to the dense model.

`split=True` builds experts that differ from the start instead (MoEfication, LLaMA-MoE): the
dense MLP's hidden units are cut into n_experts slices, expert e holding slice e (its rows of
gate and up, its columns of down), so the MoE has the dense model's parameters plus the router.
Each expert's down projection is scaled by n_experts: with all experts routed (top_k =
n_experts) and near-uniform weights the block is the dense MLP; with top_k < n_experts the
expected output over a uniform choice is, and the model needs training (continued pretraining
or the SFT warm-up) to recover what the unrouted slices held.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import Tensor, nn

from ..nn.moe import MoEBlock
from .gpt import GPT, MLP


def _check(n_experts: int, top_k: int, router_std: float, expert_noise: float) -> None:
    for name, value in (("n_experts", n_experts), ("top_k", top_k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if top_k > n_experts:
        raise ValueError(f"top_k={top_k} must be <= n_experts={n_experts}")
    if not router_std > 0:
        raise ValueError(f"router_std must be > 0 (zero logits tie: one set of experts for every "
                         f"token), got {router_std!r}")
    if not expert_noise >= 0:
        raise ValueError(f"expert_noise must be >= 0, got {expert_noise!r}")


def _dense_weights(mlp: nn.Module, where: str) -> tuple[Tensor, Tensor, Tensor]:
    projs = [getattr(mlp, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
    if not all(type(p) is nn.Linear for p in projs):
        raise ValueError(f"{where}: gate_proj, up_proj and down_proj must be plain nn.Linear "
                         "(upcycle before quantize_model)")
    if any(p.bias is not None for p in projs):
        raise ValueError(f"{where}: MLP projections have biases; experts have none")
    return tuple(p.weight.detach() for p in projs)


def _perturbed(w: Tensor, noise: float, g: torch.Generator) -> Tensor:
    if noise == 0:
        return w
    # Drawn in fp32 on the CPU generator so a seed gives the same experts on any device.
    eps = torch.randn(w.shape, generator=g, dtype=torch.float32)
    return (w.float() * (1 + noise * eps.to(w.device))).to(w.dtype)


def moe_from_mlp(mlp: nn.Module, n_experts: int, top_k: int, *, router_std: float = 0.02,
                 expert_noise: float = 0.0, generator: torch.Generator | None = None,
                 where: str = "mlp", split: bool = False) -> MoEBlock:
    """An MoEBlock of n_experts copies of a SwiGLU MLP (gate_proj, up_proj, down_proj; SiLU), or
    with `split` of its hidden-unit slices (see the module doc), in the MLP's dtype and device,
    with a fresh random router; the MLP is left untouched."""
    _check(n_experts, top_k, router_std, expert_noise)
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    gate, up, down = _dense_weights(mlp, where)
    hidden, dim = gate.shape
    if split and hidden % n_experts:
        raise ValueError(f"{where}: split upcycling cuts the {hidden} hidden units into "
                         f"n_experts={n_experts} equal slices; choose n_experts dividing {hidden}")
    width = hidden // n_experts if split else hidden
    with torch.device("meta"):  # shapes only: no initialisation, no global RNG drawn
        block = MoEBlock(dim, width, n_experts, top_k, norm_topk_prob=True)
    router = torch.randn(n_experts, dim, generator=g, dtype=torch.float32) * router_std
    block.router.gate.weight = nn.Parameter(router.to(gate.device, gate.dtype))
    if split:
        units = [slice(e * width, (e + 1) * width) for e in range(n_experts)]
        gate_up = [torch.cat((gate[u], up[u]), dim=0) for u in units]
        downs = [down[:, u] * n_experts for u in units]
    else:
        gate_up = [torch.cat((gate, up), dim=0)] * n_experts  # rows [:I] gate, [I:] up
        downs = [down] * n_experts
    block.experts.gate_up_proj = nn.Parameter(torch.stack(
        [_perturbed(w, expert_noise, g) for w in gate_up]))
    block.experts.down_proj = nn.Parameter(torch.stack(
        [_perturbed(w, expert_noise, g) for w in downs]))
    return block


def upcycle_gpt(model: GPT, n_experts: int, top_k: int, *, router_std: float = 0.02,
                expert_noise: float = 0.0, seed: int = 0, split: bool = False) -> GPT:
    """A new MoE GPT (moe=True) whose every MLP is n_experts copies of `model`'s (moe_hidden =
    ffn_hidden), or with `split` its n_experts hidden-unit slices (moe_hidden = ffn_hidden /
    n_experts); all other weights copied. `model` is left unchanged."""
    if model.config.moe:
        raise ValueError("GPTConfig.moe: the model is already a mixture of experts")
    _check(n_experts, top_k, router_std, expert_noise)
    ffn = model.config.ffn_hidden
    config = dataclasses.replace(model.config, moe=True, n_experts=n_experts, top_k=top_k,
                                 moe_hidden=ffn // n_experts if split else ffn,
                                 norm_topk_prob=True)
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for i, layer in enumerate(model.model.layers):
        if not isinstance(layer.mlp, MLP):
            raise ValueError(f"model.layers.{i}.mlp is a {type(layer.mlp).__name__}, not an MLP")
        blocks.append(moe_from_mlp(layer.mlp, n_experts, top_k, router_std=router_std,
                                   expert_noise=expert_noise, generator=g,
                                   where=f"model.layers.{i}.mlp", split=split
                                   ).train(layer.mlp.training))
    # Deep copy without the dense MLPs (shared through the memo, so never copied), then swap in
    # the blocks; deepcopy keeps a tied embedding tied.
    memo = {id(layer.mlp): layer.mlp for layer in model.model.layers}
    new = copy.deepcopy(model, memo)
    new.config = new.model.config = config
    for layer, block in zip(new.model.layers, blocks, strict=True):
        layer.mlp = block
    new.aux_loss = None
    return new


def upcycle_hf(model: nn.Module, n_experts: int, top_k: int, *, router_std: float = 0.02,
               expert_noise: float = 0.0, seed: int = 0, split: bool = False) -> nn.Module:
    """Upcycle a Hugging Face dense causal LM in place (Llama, Qwen2/3, SmolLM2, ...): each decoder
    layer's `.mlp` (gate_proj, up_proj, down_proj, SiLU) becomes an fp4stack MoEBlock.

    HF's loss does not include the MoE aux loss: add `moe_aux_loss(model)` yourself. The settings
    are recorded in `model.config.fp4stack_upcycled`; a saved checkpoint reloads by upcycling the
    dense architecture again, then loading the state dict.
    """
    config = model.config
    act = getattr(config, "hidden_act", None)
    if act != "silu":
        raise ValueError(f"config.hidden_act={act!r}: experts are SwiGLU, only 'silu' upcycles")
    if getattr(config, "fp4stack_upcycled", None):
        raise ValueError("config.fp4stack_upcycled: the model is already upcycled")
    _check(n_experts, top_k, router_std, expert_noise)
    layers = [(name, m) for name, m in model.named_modules()
              if all(hasattr(getattr(m, "mlp", None), p) for p in ("gate_proj", "up_proj",
                                                                     "down_proj"))]
    if not layers:
        raise ValueError("no module with an .mlp holding gate_proj, up_proj and down_proj")
    g = torch.Generator().manual_seed(seed)
    # Build every block before swapping any, so a refused layer leaves the model as it was.
    blocks = [moe_from_mlp(m.mlp, n_experts, top_k, router_std=router_std,
                           expert_noise=expert_noise, generator=g, where=f"{name}.mlp",
                           split=split)
              for name, m in layers]
    for (_, layer), block in zip(layers, blocks, strict=True):
        layer.mlp = block.train(layer.mlp.training)
    config.fp4stack_upcycled = {"n_experts": n_experts, "top_k": top_k, "router_std": router_std,
                                "expert_noise": expert_noise, "seed": seed, "split": split}
    return model


def moe_aux_loss(model: nn.Module) -> Tensor | None:
    """Sum of the load-balance losses the model's MoEBlocks left in their last forward."""
    losses = [m.aux_loss for m in model.modules()
              if isinstance(m, MoEBlock) and m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None
