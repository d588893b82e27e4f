"""The rollout engine: batched sampling with a KV cache, in the precision one flag names.

    bf16   the policy as it is (BF16 on GPU, fp32 on CPU)
    fp8    W8A8: weights and activations FP8 E4M3 with 1x128 block scales (recipe w8a8)
    nvfp4  naive W4A4: packed NVFP4 weights, activations quantized online (recipe w4a4)
    quads  W4A4 plus activation residual compensation (recipe w4a4-rc)
    w4a16  packed NVFP4 weights, activations unquantized (recipe w4a4@weights): what a
           weight-only (qat-w) trainer multiplies, so the mismatch is the engines' alone
    nvfp4-token, quads-token  nvfp4 and quads with per-token activation scales (a global scale
           per row of x: recipes w4a4-token, w4a4-rc-token)

The engine holds its own converted copy of the policy; `sync(trainer)` refits it from the trainer
through the shared quantize path and self-checks every tensor (fp4stack.rl.sync).

Log-probs. logprobs="score" (default) scores the finished batch in one forward of the engine's
own model: the same function the trainer runs, so equal precisions give bit-equal log-probs and
the mismatch metrics measure precision alone. logprobs="sample" returns the values of the
decoding steps themselves (no extra forward; they can differ from a full forward in the last
bits, as cached decoding multiplies in other shapes). Either way they are log-probs under the
temperature-scaled distribution, before top-p truncation, which is what the trainer recomputes.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..convert import quantize_model
from ..nn.moe import Router, record_routing
from ..nn.recipe import four_over_six as with_four_over_six
from ..nn.recipe import recipe as get_recipe
from . import policy as lm
from .sync import RefitPlan, WeightUpdate, export_update, load_weights, refit_plan

PRECISIONS = {"bf16": None, "fp8": "w8a8", "nvfp4": "w4a4", "quads": "w4a4-rc",
              "w4a16": "w4a4@weights", "nvfp4-token": "w4a4-token",
              "quads-token": "w4a4-rc-token"}


@dataclass
class Rollout:
    """A left-padded batch of prompt + response; every [B, L] tensor shares the columns."""

    tokens: Tensor          # prompt (right-aligned in prompt_len columns), then the response
    mask: Tensor            # real tokens: prompt and response up to and including EOS
    response_mask: Tensor   # response tokens only
    logprobs: Tensor        # the engine's log-prob of each response token (0 elsewhere)
    prompt_len: int
    routing: dict[str, Tensor] | None = None  # experts of every position, for routing replay

    def responses(self) -> list[list[int]]:
        """Each row's response token ids (EOS included when it was sampled)."""
        out = []
        for row, keep in zip(self.tokens, self.response_mask, strict=True):
            out.append(row[keep.bool()].tolist())
        return out

    @property
    def response_lengths(self) -> Tensor:
        return self.response_mask.sum(-1)

    def to(self, device: torch.device | str) -> Rollout:
        """The same rollout with every tensor on `device` (itself when they are there)."""
        device = torch.device(device)
        if self.tokens.device == device:
            return self
        routing = (None if self.routing is None
                   else {k: v.to(device) for k, v in self.routing.items()})
        return Rollout(self.tokens.to(device), self.mask.to(device),
                       self.response_mask.to(device), self.logprobs.to(device), self.prompt_len,
                       routing)


def top_p_sorted(probs: Tensor, top_p: float) -> tuple[Tensor, Tensor]:
    """(probabilities sorted descending with all but the smallest set reaching top_p zeroed,
    the sort order): the nucleus both engines sample from."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    drop = sorted_p.cumsum(-1) - sorted_p >= top_p  # keep the smallest set reaching p
    return sorted_p.masked_fill(drop, 0.0), order


def sample_next(logits: Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """(next token [B], its log-prob under softmax(logits / temperature) [B]); greedy at
    temperature 0 (log-prob then under temperature 1)."""
    logits = logits.float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    if temperature == 0:
        nxt = logits.argmax(dim=-1)
    else:
        probs = logp.exp()
        if top_p < 1.0:
            kept, order = top_p_sorted(probs, top_p)
            probs = probs.scatter(-1, order, kept)
        nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return nxt, logp.gather(-1, nxt[:, None]).squeeze(-1)


def on_own_device(method):
    """Run an engine method with the engine's GPU as the current CUDA device: a CUDA graph is
    captured on the current device's streams, and the engine may live on another GPU than the
    trainer (engine_device), driven from another thread (whose current device is its own)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self.device.type != "cuda":
            return method(self, *args, **kwargs)
        with torch.cuda.device(self.device):
            return method(self, *args, **kwargs)
    return run


def _drop_forward_results(model: nn.Module) -> None:
    # Tensors a forward leaves on modules (MoE aux losses) carry autograd graphs, which
    # deepcopy refuses; they are per-forward results, so they are simply dropped.
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, Tensor) and value.grad_fn is not None:
                setattr(module, name, None)


def _keep_routers_float32(copy_: nn.Module, original: nn.Module) -> None:
    # fp4stack's MoE routers compute in float32 and are never quantized (convert.py): their
    # gate weights rounded to the engine's dtype would move routing logits by that rounding,
    # flipping near-tied experts against the trainer's float32 masters. (Hugging Face routers
    # multiply in the activations' dtype, so they keep the engine's.)
    originals = dict(original.named_modules())
    for name, module in copy_.named_modules():
        if isinstance(module, Router) and name in originals:
            for pname, p in module.named_parameters():
                master = originals[name].get_parameter(pname)
                dtype = torch.promote_types(master.dtype, torch.float32)
                p.data = master.detach().to(p.device, dtype, copy=True)  # not the trainer's


def _restore_constants(copy_: nn.Module, original: nn.Module) -> None:
    # Non-persistent buffers are computed constants (HF's rotary inv_freq): a BF16 copy of them
    # would shift positions, a mismatch that has nothing to do with the GEMM precision.
    persistent = set(copy_.state_dict())
    originals = dict(original.named_buffers())
    for name, buf in copy_.named_buffers():
        if name not in persistent and name in originals and buf.dtype != originals[name].dtype:
            module, _, attr = name.rpartition(".")
            owner = copy_.get_submodule(module) if module else copy_
            owner._buffers[attr] = originals[name].detach().clone().to(buf.device)


class RolloutEngine:
    """Samples responses from a converted copy of `model` in `precision` (see the module doc).

    Build it from the unconverted policy, before the trainer converts its own copy; call
    `sync(trainer_model)` before the first `generate` and after every update.
    """

    def __init__(self, model: nn.Module, tokenizer: lm.TokenizerLike, precision: str = "quads", *,
                 temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 32,
                 logprobs: str = "score", compensation: float | int | None = None,
                 compensation_mode: str | None = None, four_over_six: bool = False,
                 dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
        if logprobs not in ("score", "sample"):
            raise ValueError(f"logprobs must be 'score' or 'sample', got {logprobs!r}")
        if not temperature >= 0 or not 0 < top_p <= 1 or max_new_tokens < 1:
            raise ValueError("need temperature >= 0, 0 < top_p <= 1 and max_new_tokens >= 1; got "
                             f"{temperature}, {top_p}, {max_new_tokens}")
        self.precision, self.tokenizer = precision, tokenizer
        self.temperature, self.top_p, self.max_new_tokens = temperature, top_p, max_new_tokens
        self.logprobs = logprobs
        _drop_forward_results(model)
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        if device is not None:  # the engine's own device (None: the policy's)
            self.model.to(device)
        if dtype is not None:
            self.model.to(dtype)  # before packing: packed data, scales and amax keep their dtypes
            _restore_constants(self.model, model)
            _keep_routers_float32(self.model, model)
        self.recipe = None
        self.amax_groups: list[list[str]] = []
        if PRECISIONS[precision] is not None:
            self.recipe = get_recipe(PRECISIONS[precision])
            comp = self.recipe.compensation
            if comp is not None and (compensation is not None or compensation_mode is not None):
                self.recipe = self.recipe.with_(compensation=type(comp)(
                    k=comp.k if compensation is None else compensation,
                    mode=compensation_mode or comp.mode))
            if four_over_six:
                self.recipe = with_four_over_six(self.recipe)
            summary = quantize_model(self.model, self.recipe)
            self.amax_groups = summary.shared_amax
        self.syncs = 0
        self._plan: RefitPlan | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @on_own_device
    @torch.no_grad()
    def calibrate(self, sequences: list[list[int]]) -> int:
        """Fix the static compensation channels of the engine's quantized layers (and static
        activation amaxes, for recipes that have them) from one forward over `sequences`
        (token lists, e.g. prompts with reference completions): `convert.calibrate`. A fast
        engine recaptures its graphs after it. Returns the number of sequences seen."""
        from ..convert import calibrate

        if self.recipe is None:
            raise ValueError(f"calibrate: a {self.precision} engine has nothing to calibrate")
        if not sequences or any(len(s) == 0 for s in sequences):
            raise ValueError("calibrate needs a non-empty list of non-empty token lists")
        # One sequence a forward: no padding rows among the activations the channels are
        # chosen from.
        batches = [torch.tensor([s], device=self.device) for s in sequences]
        return calibrate(self.model, batches, forward=lambda m, t: lm.forward_logits(
            m, t, torch.ones_like(t, dtype=torch.bool)))

    def refit_plan(self) -> RefitPlan:
        """What a refit of this engine sends (read from its model once, at the first refit)."""
        if self._plan is None:
            self._plan = refit_plan(self.model, self.amax_groups)
        return self._plan

    @on_own_device
    def sync(self, trainer: nn.Module) -> int:
        """Refit from `trainer` and self-check; returns the number of tensors verified."""
        return self.load(export_update(trainer, self.refit_plan()))

    @on_own_device
    def load(self, update: WeightUpdate) -> int:
        """Load a refit made by `export_update` with this engine's plan (in this process or
        another) and self-check it; returns the number of tensors verified."""
        checked = load_weights(self.model, update)
        for module in self.model.modules():  # e.g. a cached FP8 weight a captured graph reads
            refresh = getattr(module, "refresh_inference_cache", None)
            if refresh is not None:
                refresh()
        self.syncs += 1
        return checked

    def _pad_prompts(self, prompts: list[list[int]]) -> tuple[Tensor, Tensor]:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs a non-empty list of non-empty prompts")
        width = max(len(p) for p in prompts)
        tokens = torch.full((len(prompts), width), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.bool)
        for i, p in enumerate(prompts):
            tokens[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = True
        return tokens.to(self.device), mask.to(self.device)

    @torch.no_grad()
    @on_own_device
    def generate(self, prompts: list[list[int]], generator: torch.Generator | None = None,
                 record: bool = False) -> Rollout:
        """Sample one response per prompt (repeat a prompt G times for a GRPO group).
        record=True also records every MoE block's experts for routing replay."""
        tokens, mask = self._pad_prompts(prompts)
        prompt_mask = mask
        B, P = tokens.shape
        cache = lm.new_cache(self.model, B, P + self.max_new_tokens)
        eos, pad = self.tokenizer.eos_id, self.tokenizer.pad_id
        done = torch.zeros(B, dtype=torch.bool, device=tokens.device)
        new, new_lp, alive = [], [], []
        with record_routing(self.model) as decode_routing:
            logits = lm.step(self.model, tokens, mask, cache)[:, -1]
            for i in range(self.max_new_tokens):
                nxt, lp = sample_next(logits, self.temperature, self.top_p, generator)
                nxt = nxt.masked_fill(done, pad)
                new.append(nxt)
                new_lp.append(lp)
                alive.append(~done)
                done = done | (nxt == eos)
                if done.all() or i == self.max_new_tokens - 1:
                    break
                mask = torch.cat((mask, alive[-1][:, None]), dim=1)  # EOS itself is real
                logits = lm.step(self.model, nxt[:, None], mask, cache)[:, -1]
        return self._rollout(tokens, prompt_mask, torch.stack(new, dim=1),
                             torch.stack(alive, dim=1), torch.stack(new_lp, dim=1), record,
                             decode_routing)

    def _rollout(self, tokens: Tensor, prompt_mask: Tensor, new: Tensor, response_mask: Tensor,
                 new_lp: Tensor, record: bool, decode_routing: dict[str, Tensor] | None = None
                 ) -> Rollout:
        """The Rollout of prompts `tokens` [B, P] and the decoded `new` [B, W] (response_mask,
        and the decoding steps' log-probs new_lp, [B, W]): scored here when logprobs="score"."""
        full_tokens = torch.cat((tokens, new), dim=1)
        resp = torch.cat((torch.zeros_like(prompt_mask), response_mask), dim=1)
        full_mask = torch.cat((prompt_mask, response_mask), dim=1)
        routing = None
        if self.logprobs == "score":
            with record_routing(self.model) as score_routing:
                logprobs = lm.token_logprobs(self.model, full_tokens, full_mask,
                                             self.temperature or 1.0)
            routing = score_routing if record else None
        else:
            logprobs = torch.cat((torch.zeros(tokens.shape, device=tokens.device), new_lp),
                                 dim=1)
            if record and decode_routing:  # the last token was never fed: repeat its column
                routing = {k: torch.cat((v, v[..., -1:, :]), dim=-2)
                           for k, v in decode_routing.items()}
        logprobs = logprobs.masked_fill(~resp, 0.0)
        return Rollout(full_tokens, full_mask, resp, logprobs, tokens.shape[1], routing or None)
