"""The fast rollout engine: fp4stack GPT policies decoded with static shapes and the host out of
the loop; `RolloutEngine` stays the reference it is tested against.

Why each piece is there:
- Static KV cache (models.static_cache): a growing cache changes every step's shapes; buffers
  of a fixed length L, written at a column index held on the device, give every step the same
  shapes and addresses, so one step can be captured once and replayed.
- CUDA graph: a decoding step of a small batch is hundreds of small kernel launches, and the host
  launching them is the bottleneck; a replay launches them all at once. Graphs are kept per
  (padded batch, L, max_new_tokens) and survive `sync()`, which copies into the same storages;
  if a weight tensor is ever replaced, the graphs are captured again (`_fingerprint`).
- Padded batch buckets: a graph needs a fixed batch; padding rows run on zero hidden states
  (GPT.forward_at), which stay zero, so activation amaxes, and with them the real rows' values,
  are those of the unpadded batch.
- Sampling on the device: one uniform per row and step, drawn from the caller's generator at the
  start of `generate`, turned into a token by the inverse CDF (same distribution as
  `sample_next`: softmax(logits / T), top-p truncated; argmax at T = 0).
- Done flags, the NaN/Inf check and the step counter stay on the device; the host reads them
  every `eos_check_every` steps (one sync each) and stops once every row is done.
- compile_step=True (opt-in): the step's model forward goes through torch.compile before it is
  captured, so its elementwise work (norms, RoPE, SwiGLU, residuals) runs as fused kernels:
  fewer launches in the graph. Sampling stays eager (Inductor cannot yet split the float64
  cumsum over a 32k vocabulary). Checked against the reference for bf16 and nvfp4; quads
  under compile is not (its discrete channel choice can follow a last-bit change of x).
- fuse_projections (on by default): q/k/v and gate/up run as one GEMM each where their weights
  allow (nn.fused_projections): fewer launches, the shared input quantized once (on the H200,
  dense 1B shape at batch 1: BF16 1.09x, NVFP4 1.29x the unfused tokens/s; docs/PERFORMANCE.md).
Both options keep the values multiplied but may change summation orders (fused elementwise
maths, wider GEMMs): the tokens then equal the reference's to that bound, not bit for bit.
The prefill and the scoring forward are the reference engine's own calls, so logprobs="score"
gives the reference's log-probs bit for bit whenever the tokens are the same.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..models.gpt import GPT
from ..models.static_cache import StaticKVCache, decode_mask
from ..nn.fused_projections import fuse_projections as fuse
from . import policy as lm
from .rollout import Rollout, RolloutEngine, on_own_device, top_p_sorted

ENGINES = ("auto", "fast", "reference")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # then multiples of 256
LENGTH_BUCKET = 64  # cache lengths round up to a multiple of this: fewer graphs to capture


def batch_bucket(n: int) -> int:
    """The padded batch size a batch of n rows decodes in."""
    if n < 1:
        raise ValueError(f"batch size must be >= 1, got {n}")
    for b in BATCH_BUCKETS:
        if n <= b:
            return b
    return -(-n // BATCH_BUCKETS[-1]) * BATCH_BUCKETS[-1]


def _inverse_cdf(p: Tensor, u: Tensor) -> Tensor:
    """Per row of p [B, V] (unnormalised, >= 0) the index i with cdf[i-1] <= u * total < cdf[i]:
    a draw from p by one uniform u [B] in [0, 1). Counting (no binary search) needs no sorted
    cdf, and a zero-probability index is never chosen."""
    cdf = p.double().cumsum(-1)
    threshold = u.double()[:, None] * cdf[:, -1:]
    i = (cdf <= threshold).sum(-1).clamp(max=p.shape[-1] - 1)
    # u * total can round up to total: then take the most likely index.
    return torch.where(p.gather(-1, i[:, None]).squeeze(-1) > 0, i, p.argmax(-1))


def sample_on_device(logits: Tensor, temperature: float, top_p: float,
                     u: Tensor | None) -> tuple[Tensor, Tensor]:
    """`sample_next` without host syncs: (next token [B], its log-prob under
    softmax(logits / temperature) [B]), drawn by the uniforms u [B]; greedy at temperature 0
    (log-prob then under temperature 1). Top-p keeps the smallest set reaching p."""
    logits = logits.float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    if temperature == 0:
        nxt = logits.argmax(dim=-1)
    else:
        probs = logp.exp()
        if top_p < 1.0:
            kept, order = top_p_sorted(probs, top_p)
            pick = _inverse_cdf(kept, u)
            nxt = order.gather(-1, pick[:, None]).squeeze(-1)
        else:
            nxt = _inverse_cdf(probs, u)
    return nxt, logp.gather(-1, nxt[:, None]).squeeze(-1)


@dataclass
class _Slot:
    """The static buffers of one (padded batch, cache length, max_new_tokens), and the graphs
    captured on them (by sampling settings). Every tensor keeps its storage for its lifetime."""

    caches: list[StaticKVCache]
    column: Tensor     # [1] long: the cache column the next fed token is written to
    step: Tensor       # [1] long: the response position the next sampled token fills
    tok: Tensor        # [Bp] long: the token fed next
    alive: Tensor      # [Bp] bool: whether that token is real (its row was not done)
    done: Tensor       # [Bp] bool: EOS sampled, or a padding row
    rows: Tensor       # [Bp] bool: real rows (False: padding rows, run on zeros)
    real: Tensor       # [Bp, L] bool: the cache columns holding real tokens
    n_real: Tensor     # [Bp] long: real tokens so far (a new token's RoPE position is this - 1)
    noise: Tensor      # [n, Bp] float64: the uniforms of each step's draw
    out_tok: Tensor    # [Bp, n] long: sampled tokens (pad after a row's EOS)
    out_lp: Tensor     # [Bp, n] float32: their log-probs
    out_alive: Tensor  # [Bp, n] bool: the response mask
    bad_step: Tensor   # [1] long: the first step with non-finite logits, -1 if none
    status: Tensor     # [2] long: (all rows done, bad_step): what the host reads at a check
    graphs: dict = field(default_factory=dict)
    fingerprint: tuple = ()

    @classmethod
    def allocate(cls, model: GPT, batch: int, length: int, n: int, dtype: torch.dtype,
                 device: torch.device) -> _Slot:
        cfg = model.config
        column = torch.zeros(1, dtype=torch.long, device=device)
        caches = [StaticKVCache(batch, length, cfg.n_kv_heads, cfg.head_size, column, dtype,
                                device) for _ in range(cfg.n_layers)]
        long = dict(dtype=torch.long, device=device)
        flag = dict(dtype=torch.bool, device=device)
        return cls(caches, column, torch.zeros(1, **long), torch.zeros(batch, **long),
                   torch.zeros(batch, **flag), torch.zeros(batch, **flag),
                   torch.zeros(batch, **flag), torch.zeros(batch, length, **flag),
                   torch.zeros(batch, **long),
                   torch.zeros(n, batch, dtype=torch.float64, device=device),
                   torch.zeros(batch, n, **long),
                   torch.zeros(batch, n, dtype=torch.float32, device=device),
                   torch.zeros(batch, n, **flag), torch.zeros(1, **long), torch.zeros(2, **long))

    def reset(self, prompt_mask: Tensor, pad: int) -> None:
        """Start the sequences of prompt_mask [b, P] (rows [:b]; the rest are padding rows)."""
        b, p = prompt_mask.shape
        for cache in self.caches:
            cache.zero_()
        self.real.zero_()
        self.real[:b, :p] = prompt_mask
        self.rows.zero_()
        self.rows[:b] = True
        self.n_real.zero_()
        self.n_real[:b] = prompt_mask.sum(-1)
        self.done.copy_(~self.rows)
        self.alive.zero_()
        self.tok.fill_(pad)
        self.column.fill_(p)
        self.step.zero_()
        self.bad_step.fill_(-1)
        self.status.zero_()
        self.noise.zero_()


class FastRolloutEngine(RolloutEngine):
    """RolloutEngine for fp4stack GPT policies with a static KV cache, graph-captured decoding
    steps (on CUDA, `use_cuda_graph`; eager elsewhere, same code) and device-side sampling.
    EOS and NaN/Inf logits are checked every `eos_check_every` steps. See the module doc."""

    def __init__(self, model: nn.Module, tokenizer: lm.TokenizerLike, precision: str = "quads",
                 *, use_cuda_graph: bool | None = None, eos_check_every: int = 8,
                 max_slots: int = 4, compile_step: bool = False,
                 fuse_projections: bool = True, **kwargs) -> None:
        if not isinstance(model, GPT):
            raise ValueError(f"FastRolloutEngine runs fp4stack GPT policies only, not "
                             f"{type(model).__name__}; use RolloutEngine (engine='reference') "
                             "for Hugging Face models")
        if not (isinstance(eos_check_every, int) and eos_check_every >= 1):
            raise ValueError(f"eos_check_every must be an int >= 1, got {eos_check_every!r}")
        if not (isinstance(max_slots, int) and max_slots >= 1):
            raise ValueError(f"max_slots must be an int >= 1, got {max_slots!r}")
        super().__init__(model, tokenizer, precision, **kwargs)
        self.use_cuda_graph = use_cuda_graph
        self.eos_check_every = eos_check_every
        self.max_slots = max_slots
        self.compile_step = bool(compile_step)
        # Before any slot exists: the graphs read the fused layout's addresses.
        self.fused_groups = fuse(self.model) if fuse_projections else 0
        # dynamic=False: one specialised kernel set per slot shape, as the graphs are per slot.
        self._forward_at = (torch.compile(self.model.forward_at, dynamic=False) if compile_step
                            else self.model.forward_at)
        self._slots: OrderedDict[tuple[int, int, int], _Slot] = OrderedDict()

    @property
    def graphs_enabled(self) -> bool:
        """Whether decoding steps are graph-captured (CUDA, and use_cuda_graph not False)."""
        return self.device.type == "cuda" and self.use_cuda_graph is not False

    @property
    def captured_graphs(self) -> int:
        """How many decoding steps are held as captured CUDA graphs (0: every step ran eagerly,
        e.g. after a failed capture)."""
        return sum(g is not None for s in self._slots.values() for g in s.graphs.values())

    def _fingerprint(self) -> tuple:
        # Where every weight lives: a captured graph reads these addresses.
        return tuple((name, t.data_ptr()) for name, t in
                     (*self.model.named_parameters(), *self.model.named_buffers()))

    def _slot(self, batch: int, length: int, n: int) -> _Slot:
        key = (batch, length, n)
        slot = self._slots.pop(key, None)
        if slot is None:
            while len(self._slots) >= self.max_slots:
                self._slots.popitem(last=False)  # least recently used
            dtype = self.model.model.embed_tokens.weight.dtype
            slot = _Slot.allocate(self.model, batch, length, n, dtype, self.device)
        self._slots[key] = slot
        fingerprint = self._fingerprint()
        if slot.fingerprint != fingerprint:
            slot.graphs.clear()
            slot.fingerprint = fingerprint
        return slot

    # ---- one step --------------------------------------------------------------------------
    def _advance(self, s: _Slot, logits: Tensor) -> None:
        """Sample from logits [Bp, V] into response position `s.step`; update the flags."""
        tok = self.tokenizer
        nonfinite = (~torch.isfinite(logits).all(-1) & s.rows).any()
        s.bad_step.copy_(torch.where((s.bad_step < 0) & nonfinite, s.step, s.bad_step))
        u = s.noise.index_select(0, s.step)[0] if self.temperature != 0 else None
        nxt, lp = sample_on_device(logits, self.temperature, self.top_p, u)
        nxt = nxt.masked_fill(s.done, tok.pad_id)
        alive = ~s.done
        s.done.logical_or_(nxt == tok.eos_id)
        s.out_tok.index_copy_(1, s.step, nxt[:, None])
        s.out_lp.index_copy_(1, s.step, lp[:, None])
        s.out_alive.index_copy_(1, s.step, alive[:, None])
        s.tok.copy_(nxt)
        s.alive.copy_(alive)
        s.status.copy_(torch.cat((s.done.all().long()[None], s.bad_step)))
        s.step.add_(1)

    def _decode(self, s: _Slot) -> None:
        """Feed `s.tok` at `s.column`, then sample the next token: the captured step."""
        s.real.index_copy_(1, s.column, s.alive[:, None])  # EOS itself is real
        s.n_real.add_(s.alive)
        positions = (s.n_real - 1).clamp(min=0)[:, None]
        mask = decode_mask(s.real, s.column)
        logits = self._forward_at(s.tok[:, None], positions, mask, s.caches, s.rows)
        self._advance(s, logits[:, -1])
        s.column.add_(1)

    def _warm_up(self, s: _Slot, steps: int) -> None:
        """Run the step (at most `steps` times) from a start of pad tokens: kernels compile and
        caches fill before a capture. The state it leaves is reset by generate."""
        s.reset(torch.ones(s.tok.shape[0], 1, dtype=torch.bool, device=self.device),
                self.tokenizer.pad_id)
        for _ in range(min(2, steps)):
            self._decode(s)

    def _capture(self, s: _Slot, steps: int) -> torch.cuda.CUDAGraph | None:
        """The graph of `_decode` on s, captured after a warm-up on a side stream (PyTorch's
        recipe); None, with a warning, when the step cannot be captured (a host sync in it)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._warm_up(s, steps)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: a trainer working in another thread meanwhile (off_policy: 1) does
            # not invalidate the capture; the graph's allocations stay on its capture stream.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._decode(s)
        except RuntimeError as e:
            warnings.warn(f"FastRolloutEngine: the decoding step could not be captured in a "
                          f"CUDA graph ({e}); it runs eagerly. A host sync inside the model's "
                          "forward is the usual cause.", RuntimeWarning, stacklevel=3)
            return None
        return graph

    def _check(self, s: _Slot) -> bool:
        """One host sync: whether every row is done; raises on non-finite logits."""
        all_done, bad = s.status.tolist()
        if bad >= 0:
            raise ValueError(f"the policy's logits hold NaN or Inf at decoding step {bad} "
                             f"(response token {bad}, 0 = the prefill's); the rollout stops "
                             "rather than sample from them. Check the synced weights and the "
                             "rollout precision")
        return bool(all_done)

    # ---- generate --------------------------------------------------------------------------
    @torch.no_grad()
    @on_own_device
    def generate(self, prompts: list[list[int]], generator: torch.Generator | None = None,
                 record: bool = False) -> Rollout:
        """As RolloutEngine.generate. record=True needs logprobs="score" here (the routing is
        recorded by the scoring forward, not inside the captured steps)."""
        if record and self.logprobs != "score":
            raise ValueError("FastRolloutEngine records MoE routing from the scoring forward: "
                             "record=True needs logprobs='score' (or use RolloutEngine)")
        tokens, prompt_mask = self._pad_prompts(prompts)
        B, P = tokens.shape
        n, limit = self.max_new_tokens, self.model.config.max_seq_len
        if P + n - 1 > limit:
            raise ValueError(f"prompt ({P}) + max_new_tokens ({n}) - 1 = {P + n - 1} tokens "
                             f"exceed the policy's max_seq_len={limit}")
        s = self._slot(batch_bucket(B), -(-(P + n) // LENGTH_BUCKET) * LENGTH_BUCKET, n)
        graph = None
        if n > 1 and self.graphs_enabled:
            key = (self.temperature, self.top_p, self.tokenizer.eos_id, self.tokenizer.pad_id)
            if key not in s.graphs:
                s.graphs[key] = self._capture(s, n - 1)
            graph = s.graphs[key]
        s.reset(prompt_mask, self.tokenizer.pad_id)
        if self.temperature != 0:
            s.noise.copy_(torch.rand(s.noise.shape, generator=generator, dtype=torch.float64,
                                     device=self.device))
        cache = lm.new_cache(self.model, B, P)
        logits = lm.step(self.model, tokens, prompt_mask, cache)[:, -1]  # the reference's prefill
        for static, grown in zip(s.caches, cache, strict=True):
            static.load(grown.k, grown.v)
        padded = logits.new_zeros(s.tok.shape[0], logits.shape[-1])
        padded[:B] = logits
        self._advance(s, padded)
        steps = 1
        while steps < n and not (steps % self.eos_check_every == 0 and self._check(s)):
            if graph is not None:
                graph.replay()
            else:
                self._decode(s)
            steps += 1
        self._check(s)
        width = int(s.out_alive[:B, :steps].sum(1).max())  # the reference stops there
        return self._rollout(tokens, prompt_mask, s.out_tok[:B, :width].clone(),
                             s.out_alive[:B, :width].clone(), s.out_lp[:B, :width].clone(),
                             record)


def resolve_engine(kind: str, model: nn.Module, *, logprobs: str = "score",
                   record: bool = False, device: torch.device | str | None = None) -> str:
    """"fast" or "reference" for engine option `kind`: "auto" is fast for fp4stack GPT policies
    on CUDA (the engine's `device`, else the model's; unless routing must be recorded with
    logprobs="sample"), reference otherwise."""
    if kind not in ENGINES:
        raise ValueError(f"engine must be one of {list(ENGINES)}, got {kind!r}")
    if kind == "reference":
        return kind
    sample_record = record and logprobs != "score"
    if kind == "fast":
        if not isinstance(model, GPT):
            raise ValueError(f"engine 'fast' runs fp4stack GPT policies only, not "
                             f"{type(model).__name__}: use engine 'reference' (or 'auto')")
        if sample_record:
            raise ValueError("engine 'fast' records MoE routing from the scoring forward only: "
                             "routing replay with logprobs 'sample' needs engine 'reference' "
                             "(or logprobs 'score')")
        return kind
    on_cuda = torch.device(device or next(model.parameters()).device).type == "cuda"
    return "fast" if isinstance(model, GPT) and on_cuda and not sample_record else "reference"


def build_engine(kind: str, model: nn.Module, tokenizer: lm.TokenizerLike,
                 precision: str = "quads", *, record: bool = False,
                 fast_options: dict | None = None, **kwargs) -> RolloutEngine:
    """The rollout engine `kind` ("auto", "fast" or "reference", see `resolve_engine`) names,
    built from the unconverted policy. kwargs go to either engine's constructor, fast_options
    (use_cuda_graph, eos_check_every, max_slots, compile_step, fuse_projections) to the fast one
    only; record: whether generate will be asked to record MoE routing."""
    chosen = resolve_engine(kind, model, logprobs=kwargs.get("logprobs", "score"), record=record,
                            device=kwargs.get("device"))
    if chosen == "fast":
        return FastRolloutEngine(model, tokenizer, precision, **(fast_options or {}), **kwargs)
    return RolloutEngine(model, tokenizer, precision, **kwargs)
