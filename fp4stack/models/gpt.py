"""A small Llama/Qwen3-style GPT, dense or mixture-of-experts, with Hugging Face module names.

Module names follow Qwen3 / Qwen3-MoE in transformers (model.embed_tokens, model.layers[i].self_attn
.q_proj, .mlp.gate_proj, .mlp.experts, model.norm, lm_head), so conversion rules written for HF
models apply here too. The one difference: the MoE router is `.mlp.router.gate` (HF: `.mlp.gate`).

Left-padded batches (prompts of different lengths right-aligned, as a batched rollout engine
feeds them) run through `attention_mask` [B, L]: 1 for a real token, 0 for padding, covering every
position so far (cached ones plus the new columns). A real token's position is the number of real
tokens before it and it attends causally to real tokens only, so each row gives the logits it
would give alone, unpadded, to fp32 rounding. Pad tokens still run through every layer (their
outputs are meaningless and must be ignored); a pad query, having no real key to read, attends to
itself, which keeps it finite.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.fused_projections import project
from ..nn.moe import (
    Experts,
    KeepsAuxLoss,
    MoEBlock,
    record_routing,
    replay_routing,
)
from .rope import apply_rope, rope_cos_sin


@dataclass
class GPTConfig:
    """Shape of a GPT; checked on construction (ValueError naming the field)."""

    vocab_size: int = 32768
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int = 4  # grouped-query attention: n_heads / n_kv_heads query heads share a K/V
    ffn_hidden: int = 2048  # SwiGLU hidden size of the dense MLP
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    qk_norm: bool = True  # RMSNorm on each head's q and k before RoPE (Qwen3)
    qk_norm_scope: str = "head"  # "head": per head (Qwen3); "projection": over all of
    # q_proj's and k_proj's outputs, before the split into heads (OLMoE)
    tie_embeddings: bool = False
    moe: bool = False  # every block's MLP is an MoEBlock
    n_experts: int = 8
    top_k: int = 2
    moe_hidden: int = 512  # SwiGLU hidden size of each expert
    aux_loss_coef: float = 0.001  # HF's router_aux_loss_coef normalisation (see load_balance_loss)
    norm_topk_prob: bool = True
    head_dim: int | None = None  # default dim // n_heads
    init_std: float = 0.02

    def __post_init__(self):
        positive = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden",
                    "max_seq_len", "n_experts", "top_k", "moe_hidden")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GPTConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if not self.aux_loss_coef >= 0:
            raise ValueError(f"GPTConfig.aux_loss_coef must be >= 0, got {self.aux_loss_coef!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"GPTConfig.n_kv_heads={self.n_kv_heads} must divide "
                             f"n_heads={self.n_heads}")
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"GPTConfig.n_heads={self.n_heads} must divide dim={self.dim} "
                             "(or set head_dim)")
        if self.head_size < 2 or self.head_size % 2:
            raise ValueError(f"GPTConfig.head_dim={self.head_size} must be even for RoPE")
        if self.qk_norm_scope not in ("head", "projection"):
            raise ValueError(f"GPTConfig.qk_norm_scope must be 'head' or 'projection', got "
                             f"{self.qk_norm_scope!r}")
        if self.top_k > self.n_experts:
            raise ValueError(f"GPTConfig.top_k={self.top_k} must be <= n_experts="
                             f"{self.n_experts}")

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    # Presets. Sizes are multiples of 16 so every GEMM operand splits into NVFP4 blocks.
    @classmethod
    def tiny(cls, **overrides) -> GPTConfig:
        """About 0.1M parameters: CPU tests in milliseconds."""
        base = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                    max_seq_len=64)
        return cls(**{**base, **overrides})

    @classmethod
    def tiny_moe(cls, **overrides) -> GPTConfig:
        """tiny() with a 4-expert, top-2 MoE in every block."""
        return cls.tiny(**{"moe": True, "n_experts": 4, "top_k": 2, "moe_hidden": 32, **overrides})

    @classmethod
    def small(cls, **overrides) -> GPTConfig:
        """About 126M parameters (32k vocabulary, untied): single-GPU pretraining runs."""
        return cls(**overrides)

    @classmethod
    def small_moe(cls, **overrides) -> GPTConfig:
        """small() with 16 experts, top-4, 512 hidden each: 296M parameters, 126M active."""
        return cls(**{"moe": True, "n_experts": 16, "top_k": 4, "moe_hidden": 512, **overrides})


class KVCache:
    """Keys and values of one layer for incremental decoding; allocated on first use."""

    def __init__(self, max_len: int):
        self.max_len, self.pos = max_len, 0
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append k, v [B, Hkv, S, hd]; return all keys and values so far."""
        if self.k is None:
            shape = (*k.shape[:2], self.max_len, k.shape[3])
            self.k = k.new_zeros(shape)
            self.v = v.new_zeros(shape)
        end = self.pos + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KVCache holds {self.max_len} positions, {end} requested")
        self.k[:, :, self.pos:end] = k
        self.v[:, :, self.pos:end] = v
        self.pos = end
        return self.k[:, :, :end], self.v[:, :, :end]


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_size
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        # Over the whole projection (OLMoE) the norms see all heads at once: sizes H*hd, Hkv*hd.
        self.qk_norm_heads = cfg.qk_norm_scope == "head"
        q_size, k_size = ((self.head_dim, self.head_dim) if self.qk_norm_heads
                          else (cfg.n_heads * self.head_dim, cfg.n_kv_heads * self.head_dim))
        self.q_norm = nn.RMSNorm(q_size, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(k_size, eps=cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None = None,
                mask: Tensor | None = None) -> Tensor:
        B, S, _ = x.shape
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        if self.q_norm is not None and not self.qk_norm_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, S, self.n_heads, self.head_dim)
        k = k.view(B, S, self.n_kv_heads, self.head_dim)
        v = v.view(B, S, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.qk_norm_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v)
        # Without a mask, the three-argument call that attend overrides written before masks expect.
        y = self.attend(q, k, v) if mask is None else self.attend(q, k, v, mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, -1))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        """Attention of q [B, H, S, hd], the last S of the L positions in k, v [B, Hkv, L, hd].

        mask None: causal. Otherwise mask is a boolean "may attend" tensor [B, 1, S, L] that
        already holds causality, padding and a True diagonal (so no query row is all False); it is
        used as given. The one place attention is computed, for an FP4 attention to override
        (this method makes the class an fp4stack.nn.attention.AttentionBlock).
        """
        if self.n_kv_heads != self.n_heads:  # query head h reads K/V head h // rep (HF repeat_kv)
            rep = self.n_heads // self.n_kv_heads
            B, H, S, hd = q.shape
            if S == 1 and mask is not None and mask.dim() == 4 and mask.shape[1] == 1:
                # Decoding: a K/V head's rep query heads are rep queries of one position, with
                # one mask; no copy of the whole cache per step (rep times its size).
                y = F.scaled_dot_product_attention(q.reshape(B, self.n_kv_heads, rep, hd), k, v,
                                                   attn_mask=mask)
                return y.reshape(B, H, 1, hd)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        S, L = q.shape[2], k.shape[2]
        if S == L:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        mask = None if S == 1 else torch.ones(S, L, dtype=torch.bool, device=q.device).tril(L - S)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = project(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = (MoEBlock(cfg.dim, cfg.moe_hidden, cfg.n_experts, cfg.top_k,
                             cfg.norm_topk_prob) if cfg.moe else MLP(cfg.dim, cfg.ffn_hidden))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None = None,
                mask: Tensor | None = None, real: Tensor | None = None) -> Tensor:
        """real [B, S] bool: the real tokens the MoE aux loss balances (None: all)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, mask)
        h = self.post_attention_layernorm(x)
        if real is None or not isinstance(self.mlp, MoEBlock):
            return x + self.mlp(h)
        return x + self.mlp(h, real)


def padded_causal_mask(real: Tensor, new: int) -> Tensor:
    """The "may attend" mask [B, 1, new, L] of the last `new` of L positions, real [B, L] bool:
    causal, real keys only, and each query its own key (a pad query has no real one)."""
    L = real.shape[1]
    q_pos = torch.arange(L - new, L, device=real.device)[:, None]
    k_pos = torch.arange(L, device=real.device)[None, :]
    return ((k_pos <= q_pos) & real[:, None, None, :]) | (k_pos == q_pos)


class Transformer(nn.Module):
    """Embedding, blocks and final norm: HF's `model` submodule."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        # RoPE's cos and sin at every position, in fp32, gathered by each forward. Compiled, a
        # forward that computes them itself has the powers and sines fused into every kernel
        # that reads them, recomputed for each of B x H rows, forward and backward. Not saved
        # (persistent=False) and remade in fp32 after every move or cast (_apply).
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self._make_rope_tables()

    def _make_rope_tables(self, device: torch.device | None = None) -> None:
        with torch.no_grad():
            positions = torch.arange(self.config.max_seq_len, device=device or self.rope_cos.device)
            self.rope_cos, self.rope_sin = rope_cos_sin(positions, self.config.head_size,
                                                        self.config.rope_theta)

    def _rope_at(self, positions: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
        # rope_cos_sin's bits at `positions`; tables built on meta (weights assigned since) are
        # made on the input's device first.
        if self.rope_cos.device != device:
            self._make_rope_tables(device)
        return self.rope_cos[positions], self.rope_sin[positions]

    def _apply(self, fn, recurse: bool = True):
        if self.rope_cos.is_meta:  # weights assigned to a meta model: nothing to copy here
            self.rope_cos, self.rope_sin = torch.empty(0), torch.empty(0)
        super()._apply(fn, recurse)
        self._make_rope_tables()  # model.to(bf16) must not round them; to_empty fills them
        return self

    def forward(self, idx: Tensor, kv_caches: list[KVCache] | None = None,
                attention_mask: Tensor | None = None) -> Tensor:
        """Final hidden states [B, S, D]; attention_mask as in GPT.forward."""
        B, S = idx.shape
        start = kv_caches[0].pos if kv_caches else 0
        if start + S > self.config.max_seq_len:
            raise ValueError(f"sequence of {start + S} tokens exceeds "
                             f"max_seq_len={self.config.max_seq_len}")
        mask = real = None
        if attention_mask is None:
            positions = torch.arange(start, start + S, device=idx.device)
        else:
            if attention_mask.shape != (B, start + S):
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, "
                                 f"expected (batch, cached + new) = {(B, start + S)}")
            real_all = attention_mask.to(idx.device) != 0
            # A real token's position counts the real tokens before it; pads clamp to 0.
            positions = (real_all.long().cumsum(-1) - 1).clamp(min=0)[:, start:]
            mask = padded_causal_mask(real_all, S)
            real = real_all[:, start:]  # the tokens the MoE aux loss balances
        cos, sin = self._rope_at(positions, idx.device)
        x = self.embed_tokens(idx)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_caches[i] if kv_caches else None, mask, real)
        return self.norm(x)

    def forward_at(self, idx: Tensor, positions: Tensor, mask: Tensor, caches: list,
                   rows: Tensor | None = None) -> Tensor:
        """Final hidden states [B, S, D] of idx [B, S] at the RoPE positions [B, S] given,
        attending as the "may attend" mask [B, 1, S, L] says over the L columns of fixed-size
        caches (models.static_cache): decoding with static shapes, no host value involved.

        rows [B] bool: rows marked False run on zero hidden states, which every block maps to
        zero (no biases; RMSNorm, attention, SwiGLU, experts and quantizers keep 0 at 0), so a
        batch padded with such rows quantizes its real rows with the same amaxes."""
        cos, sin = self._rope_at(positions, idx.device)
        x = self.embed_tokens(idx)
        if rows is not None:
            x = torch.where(rows[:, None, None], x, 0)
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, cos, sin, cache, mask)
        return self.norm(x)


class GPT(KeepsAuxLoss):
    """Decoder-only LM. forward(idx [B, S], targets [B, S] | None) -> (logits [B, S, V], loss)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.model = Transformer(config)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.aux_loss: Tensor | None = None  # sum of the MoE aux losses of the last forward
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std); projections into the residual stream scaled by 1/sqrt(2 L)."""
        std = self.config.init_std
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, Experts):
                nn.init.normal_(m.gate_up_proj, std=std)
            elif isinstance(m, nn.RMSNorm):
                nn.init.ones_(m.weight)
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "mlp.down_proj.weight", "experts.down_proj")):
                nn.init.normal_(p, std=std / math.sqrt(2 * self.config.n_layers))

    def forward(self, idx: Tensor, targets: Tensor | None = None, *,
                kv_caches: list[KVCache] | None = None,
                attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits for every position; with targets, loss = CE (ignore_index -100) plus
        aux_loss_coef * the summed MoE load-balance losses. With kv_caches (one KVCache per
        layer) idx continues the positions already cached, as in generate().

        attention_mask [B, L] (bool or 0/1) marks real tokens (1) and padding (0) over all L =
        cached + S positions; pass the grown mask at every decoding step. Logits at pad positions
        are meaningless: give them target -100. The MoE aux loss counts real tokens only (with
        grad enabled; without, it is over every token, or None where blocks skip it).
        """
        logits = self.lm_head(self.model(idx, kv_caches, attention_mask))
        # A block computes no aux loss when no gradient is needed (it would sync with the host).
        aux = [layer.mlp.aux_loss for layer in self.model.layers
               if isinstance(layer.mlp, MoEBlock) and layer.mlp.aux_loss is not None]
        self.aux_loss = torch.stack(aux).sum() if aux else None
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
        if self.aux_loss is not None:
            loss = loss + self.config.aux_loss_coef * self.aux_loss
        return logits, loss

    def forward_at(self, idx: Tensor, positions: Tensor, mask: Tensor, caches: list,
                   rows: Tensor | None = None) -> Tensor:
        """Logits [B, S, V] of a static-shape decoding step (see Transformer.forward_at); the
        MoE aux loss is not collected."""
        return self.lm_head(self.model.forward_at(idx, positions, mask, caches, rows))

    def num_params(self, active: bool = False) -> int:
        """Parameter count (tied weights once); active=True counts only top_k of the experts."""
        n = sum(p.numel() for p in self.parameters())
        if active and self.config.moe:
            expert = sum(p.numel() for m in self.modules() if isinstance(m, Experts)
                         for p in m.parameters())
            n -= expert - expert * self.config.top_k // self.config.n_experts
        return n

    def record_routing(self) -> AbstractContextManager[dict[str, Tensor]]:
        """`with model.record_routing() as routing:` -> {MoE block name: indices [B, S, k]}."""
        return record_routing(self)

    def replay_routing(self, routing: dict[str, Tensor]) -> AbstractContextManager[None]:
        """`with model.replay_routing(routing):` forces the recorded experts in every MoE block."""
        return replay_routing(self, routing)

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 attention_mask: Tensor | None = None) -> Tensor:
        """Sample max_new_tokens after idx [B, S] with a KV cache; temperature 0 is greedy.

        attention_mask [B, S] marks the real tokens of a left-padded prompt batch; generated
        tokens count as real. The output keeps the padding: [B, S + max_new_tokens].

        Inside record_routing this records the routing of every token fed to the model, i.e. of
        the returned sequence without its last token: replay it on `out[:, :-1]`.
        """
        total = idx.shape[1] + max_new_tokens - 1  # the last sampled token is never fed
        if total > self.config.max_seq_len:
            raise ValueError(f"prompt + max_new_tokens - 1 = {total} exceeds "
                             f"max_seq_len={self.config.max_seq_len}")
        caches = [KVCache(max(total, idx.shape[1])) for _ in self.model.layers]
        mask = None if attention_mask is None else attention_mask.to(idx.device) != 0
        logits, _ = self(idx, kv_caches=caches, attention_mask=mask)
        for i in range(max_new_tokens):
            nxt = sample(logits[:, -1], temperature, top_k, generator)
            idx = torch.cat((idx, nxt), dim=1)
            if i < max_new_tokens - 1:
                if mask is not None:
                    mask = torch.cat((mask, torch.ones_like(nxt, dtype=torch.bool)), dim=1)
                logits, _ = self(nxt, kv_caches=caches, attention_mask=mask)
        return idx


def sample(logits: Tensor, temperature: float = 1.0, top_k: int | None = None,
           generator: torch.Generator | None = None) -> Tensor:
    """Next token [B, 1] from logits [B, V]; temperature 0 is argmax."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
