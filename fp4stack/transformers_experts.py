"""NVFP4 MoE experts of a transformers model loaded from a compressed-tensors checkpoint, with
their global scales.

transformers (5.24 and 5.25 with compressed-tensors 0.20) dequantizes a checkpoint's per-expert
NVFP4 linears into its fused expert stacks (`gate_up_proj` [E, 2I, D], `down_proj` [E, D, I])
from `weight_packed` and `weight_scale` alone: its `CompressedTensorsDequantize` drops each
expert's `weight_global_scale`, so every expert weight it holds is the right one times that
scale. Dense layers are decompressed correctly. `restore_expert_weights` decompresses each
expert again with compressed-tensors' own NVFP4 decompressor, global scale included, and writes
it into the stacks; what it finds already right (a transformers that applies the scale) it
leaves, and what matches neither decompression it refuses, so it never writes over weights it
does not understand.

    model = AutoModelForCausalLM.from_pretrained(directory)
    fp4stack.restore_expert_weights(model, directory)
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from .compressed_tensors_moe import PARTS, checkpoint_names, dims, expert_name
from .compressed_tensors_read import read_checkpoint
from .nn.quant_experts import is_hf_fused_experts

_NVFP4_KEYS = ("weight_packed", "weight_scale", "weight_global_scale")


def _decompressor():
    try:
        import compressed_tensors.compressors.nvfp4 as nvfp4
        from compressed_tensors.quantization import QuantizationScheme
        from compressed_tensors.quantization.quant_scheme import NVFP4A16
    except ImportError as e:
        raise ImportError("restore_expert_weights needs compressed-tensors "
                          "(pip install 'fp4stack[hf]')") from e
    scheme = QuantizationScheme(targets=["Linear"], **NVFP4A16)  # weights as in NVFP4 (W4A4)

    def decompress(tensors: dict[str, torch.Tensor], with_global_scale: bool) -> torch.Tensor:
        keys = _NVFP4_KEYS if with_global_scale else _NVFP4_KEYS[:2]
        state = {k: tensors[k] for k in keys}
        return nvfp4.NVFP4PackedCompressor.decompress(state, scheme)["weight"]

    return decompress


def restore_expert_weights(model: nn.Module, directory: str | os.PathLike) -> int:
    """Rewrite the NVFP4 experts of a transformers MoE `model` loaded from the checkpoint in
    `directory` with compressed-tensors' decompression, global scale included. Returns how many
    expert projections it rewrote (0 when the loader was already right or nothing is NVFP4).
    Raises ValueError, naming the tensor, where the model's experts match neither the checkpoint
    decompressed with its global scale nor without it (another checkpoint, or a changed model)."""
    experts = {n: m for n, m in model.named_modules() if is_hf_fused_experts(m)}
    if not experts:
        return 0
    ckpt = read_checkpoint(Path(directory))
    names = checkpoint_names(model, [], [], experts)
    decompress = _decompressor()
    rewritten = 0
    for name, module in experts.items():
        n, inner, _ = dims(module)
        for e in range(n):
            for part in PARTS:
                stored = names[expert_name(name, e, part)]
                if f"{stored}.weight_packed" not in ckpt.tensors:
                    continue  # an unquantized expert: transformers loads its weight as it is
                tensors = {k: ckpt.tensors[f"{stored}.{k}"] for k in _NVFP4_KEYS}
                if part == "down_proj":
                    held = module.down_proj[e]
                else:
                    rows = slice(0, inner) if part == "gate_proj" else slice(inner, 2 * inner)
                    held = module.gate_up_proj[e, rows]
                right = decompress(tensors, with_global_scale=True).to(held.dtype)
                if torch.equal(held, right):
                    continue
                wrong = decompress(tensors, with_global_scale=False).to(held.dtype)
                if held.shape != right.shape or not torch.equal(held, wrong):
                    raise ValueError(f"{name}: expert {e} {part} ({stored} in {directory}) is "
                                     "neither the checkpoint's decompression nor transformers' "
                                     "without the global scale: load the model from this "
                                     "checkpoint first")
                with torch.no_grad():
                    held.copy_(right)
                rewritten += 1
    return rewritten
