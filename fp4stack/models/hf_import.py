"""Hugging Face checkpoints into fp4stack's GPT, and back to Hugging Face names.

`gpt_from_hf` reads a Llama (SmolLM2 included), Mistral, Qwen3, Qwen3-MoE, Mixtral or OLMoE
causal LM (an in-memory transformers model, a save_pretrained directory, or a name `hf.load`
knows such as "smollm2") into a `GPT`, which then runs every fp4stack path: recipes, the rollout
engines, the weight sync. `hf_state_dict` is the inverse: the GPT's weights under the names a
transformers model of the given config loads with `load_state_dict`.

The GPT uses Hugging Face's module names already (see gpt.py), so the mapping is a rename of one
module (the MoE router: HF `mlp.gate`, GPT `mlp.router.gate`) plus a config translation. Both
sides apply RoPE in the rotate-half layout, so q_proj and k_proj rows are copied unpermuted. (A
GGUF file stores them interleaved for llama.cpp; transformers' GGUF loader undoes that while
loading, which is why a GGUF goes through `hf.load` rather than being read here.)

What the GPT cannot compute is refused before any weight is read, with UnsupportedModel naming
the feature: other RoPE types (llama3, yarn, linear, dynamic, partial rotary), a sliding window
shorter than the sequence length asked for, biases, activations other than SiLU, clipped q/k/v,
dense MLP layers among MoE layers, shared experts, and architectures not listed above. A sliding
window at least as long as the sequences is no window at all, so such models load with
max_seq_len capped at the window.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .gpt import GPT, GPTConfig

DENSE = ("llama", "mistral", "qwen3")
MOE = ("qwen3_moe", "mixtral", "olmoe")
SUPPORTED = DENSE + MOE
# Architectures users ask for, with the feature the GPT lacks (others get the generic message).
MISSING_FEATURE = {
    "qwen2": "biases on the q/k/v projections (attention bias)",
    "qwen2_moe": "shared experts and q/k/v biases",
    "deepseek_v2": "multi-head latent attention and shared experts",
    "deepseek_v3": "multi-head latent attention and shared experts",
    "gemma": "GeGLU MLPs and (1 + weight) RMSNorm",
    "gemma2": "logit soft-capping and sliding-window layers",
    "gemma3": "sliding-window layers and (1 + weight) RMSNorm",
    "olmo2": "post-norm blocks",
    "phi3": "fused qkv and gate_up projections",
}
_ROUTER_HF, _ROUTER_GPT = ".mlp.gate.weight", ".mlp.router.gate.weight"


class UnsupportedModel(ValueError):
    """A Hugging Face model uses a feature fp4stack's GPT does not have; the message names it."""


def _refuse(model_type: str, feature: str) -> UnsupportedModel:
    return UnsupportedModel(f"{model_type}: fp4stack's GPT cannot represent {feature}")


def _rope_theta(config: Any, model_type: str) -> float:
    """The RoPE base of a plain-RoPE config (transformers 5 `rope_parameters`, or 4.x fields)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "full_attention" in params or "sliding_attention" in params:
        raise _refuse(model_type, "RoPE parameters that differ per layer type")
    legacy = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
    if rope_type != "default":
        raise _refuse(model_type, f"rope_type={rope_type!r} (it has plain RoPE, 'default', only)")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _refuse(model_type, f"partial_rotary_factor={partial} (RoPE over part of a head)")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise _refuse(model_type, "a config without rope_theta")
    return float(theta)


def _sliding_window(config: Any) -> int | None:
    """The attention window some layer uses, or None when every layer attends to everything."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)


def _check_features(config: Any, model_type: str) -> None:
    for flag, feature in (("attention_bias", "biases on the attention projections"),
                          ("mlp_bias", "biases on the MLP projections")):
        if getattr(config, flag, False):
            raise _refuse(model_type, f"{feature} ({flag}=True)")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise _refuse(model_type, f"hidden_act={act!r} (its MLPs are SwiGLU: silu)")
    if getattr(config, "clip_qkv", None) is not None:
        raise _refuse(model_type, f"clipped q/k/v (clip_qkv={config.clip_qkv})")
    if getattr(config, "pretraining_tp", 1) != 1:
        raise _refuse(model_type, f"pretraining_tp={config.pretraining_tp}")
    if model_type == "qwen3_moe":
        dense = list(getattr(config, "mlp_only_layers", None) or [])
        step = getattr(config, "decoder_sparse_step", 1)
        if dense or step != 1:
            raise _refuse(model_type, "dense MLP layers among MoE layers (mlp_only_layers="
                                      f"{dense}, decoder_sparse_step={step}); every block of a "
                                      "GPT-MoE is MoE")
    if getattr(config, "shared_expert_intermediate_size", 0) or getattr(
            config, "n_shared_experts", 0):
        raise _refuse(model_type, "shared experts")


def gpt_config_from_hf(config: Any, max_seq_len: int | None = None) -> GPTConfig:
    """The GPTConfig computing what a transformers model of `config` computes.

    max_seq_len defaults to the config's max_position_embeddings, capped at its sliding window
    (within which the window masks nothing); asking for more than the window is refused.
    Raises UnsupportedModel naming the first feature the GPT lacks.
    """
    model_type = getattr(config, "model_type", type(config).__name__)
    if model_type not in SUPPORTED:
        feature = MISSING_FEATURE.get(model_type, "this architecture")
        raise UnsupportedModel(f"{model_type}: fp4stack's GPT cannot represent {feature}; "
                               f"gpt_from_hf reads {', '.join(SUPPORTED)}")
    _check_features(config, model_type)
    rope_theta = _rope_theta(config, model_type)
    window = _sliding_window(config)
    limit = config.max_position_embeddings if window is None else min(
        config.max_position_embeddings, window)
    if max_seq_len is None:
        max_seq_len = limit
    elif window is not None and max_seq_len > window:
        raise _refuse(model_type, f"a sliding window of {window} tokens (max_seq_len="
                                  f"{max_seq_len} asked for; up to {window} is exact)")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    fields: dict[str, Any] = dict(
        vocab_size=config.vocab_size, dim=config.hidden_size, n_layers=config.num_hidden_layers,
        n_heads=heads, n_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        ffn_hidden=config.intermediate_size, max_seq_len=max_seq_len, rope_theta=rope_theta,
        norm_eps=float(config.rms_norm_eps), qk_norm=model_type in ("qwen3", "qwen3_moe", "olmoe"),
        qk_norm_scope="projection" if model_type == "olmoe" else "head",
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        head_dim=None if head_dim * heads == config.hidden_size else head_dim,
    )
    if model_type == "olmoe" and head_dim * heads != config.hidden_size:
        # OLMoE sizes its q/k norms from hidden_size // heads, not head_dim.
        raise _refuse(model_type, f"head_dim={head_dim} != hidden_size / num_attention_heads")
    if model_type in MOE:
        n_experts = getattr(config, "num_experts", None) or config.num_local_experts
        fields.update(
            moe=True, n_experts=n_experts, top_k=config.num_experts_per_tok,
            moe_hidden=(config.intermediate_size if model_type == "mixtral"
                        else getattr(config, "moe_intermediate_size", config.intermediate_size)),
            aux_loss_coef=float(getattr(config, "router_aux_loss_coef", 0.0)),
            # Mixtral always renormalises the top-k probabilities.
            norm_topk_prob=True if model_type == "mixtral" else bool(config.norm_topk_prob),
        )
    return GPTConfig(**fields)


def _gpt_name(hf_name: str) -> str:
    return hf_name[: -len(_ROUTER_HF)] + _ROUTER_GPT if hf_name.endswith(_ROUTER_HF) else hf_name


def _hf_name(gpt_name: str) -> str:
    return (gpt_name[: -len(_ROUTER_GPT)] + _ROUTER_HF if gpt_name.endswith(_ROUTER_GPT)
            else gpt_name)


def _expected_names(cfg: GPTConfig) -> dict[str, torch.Size]:
    """Parameter names and shapes of a GPT of `cfg`, built on the meta device (no memory)."""
    with torch.device("meta"):
        return {k: v.shape for k, v in GPT(cfg).state_dict().items()}


def _hf_model(model_or_dir: nn.Module | str | Path) -> nn.Module:
    if isinstance(model_or_dir, nn.Module):
        return model_or_dir
    from .hf import LoadedModel, load

    if isinstance(model_or_dir, LoadedModel):
        return model_or_dir.model
    return load(str(model_or_dir)).model


def gpt_from_hf(model_or_dir: nn.Module | str | Path, *, max_seq_len: int | None = None,
                dtype: torch.dtype | None = None) -> GPT:
    """A GPT with the weights of a Hugging Face causal LM, computing the same logits.

    model_or_dir: a transformers model (or `hf.LoadedModel`), a save_pretrained directory, or a
    name `fp4stack.models.hf.load` knows ("smollm2": the GGUF, dequantized; "tiny-moe"). The
    GPT gets copies of the weights in `dtype` (default: the model's), in eval mode.
    Raises UnsupportedModel for what the GPT cannot represent (see the module doc).
    """
    hf = _hf_model(model_or_dir)
    cfg = gpt_config_from_hf(hf.config, max_seq_len)
    expected = _expected_names(cfg)
    state = {_gpt_name(k): v for k, v in hf.state_dict().items()}
    _check_names(state, expected, "the Hugging Face model", "GPT")
    dtype = dtype or next(hf.parameters()).dtype
    with torch.device("meta"):
        gpt = GPT(cfg)
    gpt.load_state_dict({k: state[k].detach().to(dtype, copy=True) for k in expected},
                        assign=True)
    if cfg.tie_embeddings:  # assign replaced the shared Parameter by two tensors: tie again
        gpt.lm_head.weight = gpt.model.embed_tokens.weight
    return gpt.eval()


def _check_names(state: dict[str, Tensor], expected: dict[str, torch.Size], source: str,
                 target: str) -> None:
    unknown = sorted(set(state) - set(expected))
    missing = sorted(set(expected) - set(state))
    if unknown or missing:
        raise UnsupportedModel(f"{source} does not map onto a {target}: tensors without a place "
                               f"{unknown[:4]}, missing {missing[:4]}")
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise UnsupportedModel(f"{source}: {name} has shape {tuple(state[name].shape)}, the "
                                   f"{target} needs {tuple(shape)}")


def hf_state_dict(gpt: GPT, config: Any) -> dict[str, Tensor]:
    """`gpt`'s weights under the names of a transformers model of `config` (for its
    load_state_dict; the tied LM head appears under both names, as transformers lists it).

    `config` must describe the same shapes (gpt_config_from_hf(config) == gpt.config, bar
    max_seq_len and aux_loss_coef). The GPT must hold its weights in high precision: plain, or
    quantized with master weights (qat-w); a packed model (w4a4) has none, so it is refused:
    fp4stack.compressed_tensors.save_quantized writes those.
    """
    want = gpt_config_from_hf(config, gpt.config.max_seq_len)
    mine = gpt.config
    same = {f: getattr(want, f) for f in ("aux_loss_coef", "max_seq_len", "init_std")}
    if want != GPTConfig(**{**mine.__dict__, **same}):
        diff = {f: (getattr(mine, f), getattr(want, f)) for f in mine.__dict__
                if f not in same and getattr(mine, f) != getattr(want, f)}
        raise ValueError(f"hf_state_dict: the GPT and the {config.model_type} config differ in "
                         f"(gpt, config) {diff}")
    expected = _expected_names(mine)
    state = gpt.state_dict()
    packed = sorted(k for k in state if k not in expected)
    if packed:
        raise ValueError(f"hf_state_dict needs high-precision weights; {packed[0]} (and "
                         f"{len(packed) - 1} more) are not: export a packed model with "
                         "fp4stack.compressed_tensors.save_quantized")
    return {_hf_name(k): state[k] for k in expected}
