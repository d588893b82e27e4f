"""Which attention quantization hurts: the error of fp4_attention's output and gradients, one
AttentionQuant setting at a time, on real activations and on Gaussian ones.

Inputs: the q, k, v each attention block of a trained GPT sees on validation text and the
gradient of the LM loss at its output (dO), captured in float64 from a training checkpoint (of
any recipe: a quantized one loads as its master weights, every linear exact); and unit
Gaussians of the same shapes. Every configuration runs the torch reference in float64, so
the only errors are the quantizers'. Two yardsticks per gradient (relative Frobenius errors,
averaged over the blocks):

- "vs exact": against exact attention on the unquantized q, k, v (the reference with every
  quantizer off);
- "vs own forward": against the exact gradient of the function the forward computed, i.e. of
  attention on the forward's Q̂, K̂ (blocks along d) and V̂ (blocks along keys). Tensor reuse makes
  the backward differentiate exactly that function, so with reuse and dS, dP unquantized this is 0;
  it is what the method's "the two passes see the same numbers" is about. Defined where the
  forward is attention on Q̂, K̂, V̂ (all three quantized, P not); "-" elsewhere.

With --weight-grads, a third table: the error of the model's weight gradients (what the
optimizer sees), summed over training batches, when every attention block of the checkpoint's
GPT runs fp4_attention with a given setting and everything else is exact (float64): per-call
gradient errors that are systematic add up in the weight gradients; those that vary from token
to token and batch to batch partly cancel.

With --kernels (CUDA, or CPU under TRITON_INTERPRET=1), a table of the Triton kernels on the
real activations rounded to bf16, as training feeds them: their error against exact attention
and against the float64 reference of the same setting (what the kernels add). --device cuda
computes everything on the GPU (still float64).

    python experiments/study_attention_quantization.py \
        --checkpoint runs/compare/tiny-attention/bf16-s0/checkpoints/step_00000200 \
        --config configs/pretrain/tiny.yaml [--weight-grads 8] [--device cuda --kernels] \
        [--only stochastic "reuse (default)"]
    python experiments/study_attention_quantization.py --model smollm2 --tokens 512
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import load_file

from fp4stack.formats.hadamard import rht, rht_inverse
from fp4stack.models import GPT
from fp4stack.models.gpt import Attention
from fp4stack.nn.attention import (
    NVFP4_RNE,
    AttentionQuant,
    fp4_attention,
    quantize_along,
    use_fp4_attention,
)
from fp4stack.nn.attention_ablation import AttentionAblation
from fp4stack.nn.attention_quant import NVFP4_SR, NVFP4_TILES
from fp4stack.train.config import load_config
from fp4stack.train.trainer import open_data

# The configs with the ablation's fields written flat, e.g. ablated(reuse=("v",)).
ablated = AttentionAblation.quant
CONFIGS = {
    "Q, K, V, dS; reuse (default)": AttentionQuant.paper(),
    "Q, K, V, dS; no reuse": AttentionQuant(reuse=False),
    "Q, K, V; reuse (dS high precision)": AttentionQuant(ds=None),
    "Q, K, V; no reuse (dS high precision)": AttentionQuant(ds=None, reuse=False),
    "Q, K, V, dS; reuse V̂ only": ablated(reuse=("v",)),
    "Q, K, V, dS; reuse Q̂, K̂ only": ablated(reuse=("q", "k")),
    "Q, K, V, dS; reuse, re-blocked": ablated(reblock=True),
    "Q, K, V in 16x16 tiles, dS; reuse": AttentionQuant.tiled(),
    "Q, K rotated; Q, K, V, dS; reuse": ablated(rotate_qk=True),
    "Q, K rotated; Q, K, V, dS; no reuse": ablated(rotate_qk=True, reuse=False),
    "Q, K, V, dS; high-precision backward": ablated(reuse=False, requantize=False),
    "Q, K, V, dS; no reuse, fresh stochastic rounding in the forward's dims": ablated(
        reuse=False, requantize_along="forward", requantize_rounding="stochastic"),
    "Q, K, V, dS; no reuse, stochastic rounding": ablated(
        reuse=False, requantize_rounding="stochastic"),
    "Q, K, V stochastically rounded, dS; reuse": AttentionQuant(
        q=NVFP4_SR, k=NVFP4_SR, v=NVFP4_SR),
    "Q, K, V stochastically rounded, dS; no reuse": AttentionQuant(
        q=NVFP4_SR, k=NVFP4_SR, v=NVFP4_SR, reuse=False),
    "Q, K, V, dS; no reuse, delta from dP": ablated(reuse=False, delta="dp"),
    "Q, K, V; no reuse (dS high precision), delta from dP": ablated(
        ds=None, reuse=False, delta="dp"),
    "Q only": AttentionQuant.only("q"),
    "K only": AttentionQuant.only("k"),
    "V only": AttentionQuant.only("v"),
    "P only": AttentionQuant.only("p"),
    "dS only": AttentionQuant.only("ds"),
    "dP only": AttentionQuant.only("dp"),
    "all six; reuse": AttentionQuant(p=NVFP4_RNE, dp=NVFP4_RNE),
}


# What a quantized recipe's linears add to a checkpoint besides the master weights.
RECIPE_STATE = ("lowrank_a", "lowrank_b", "lowrank_forwards", "weight_amax", "x_amax",
                "rc_channels")


def load_model(checkpoint: Path, config: str, device: str):
    """The checkpoint's GPT on `device`, and the (train, val) data of its config. A checkpoint
    of a quantized recipe loads as its master weights in a plain GPT, every linear exact (the
    low-rank branch only stands in for W - Q(W), which the exact linear already has), so that
    attention is the only quantized part."""
    cfg = load_config(config)
    train, val = open_data(cfg)
    model = GPT(cfg.model_config(val.vocab_size))
    state = load_file(str(checkpoint / "model.safetensors"))
    model.load_state_dict({k: t for k, t in state.items()
                           if k.rpartition(".")[2] not in RECIPE_STATE})
    return cfg, train, val, model.to(device)


def capture(checkpoint: Path, config: str, batches: int,
            device: str = "cpu") -> list[tuple[torch.Tensor, ...]]:
    """(q, k, v, dO) in float64 at every attention block of the checkpoint's GPT, on the first
    `batches` validation batches; K/V heads repeated to the query heads, as the block does."""
    cfg, _, val, model = load_model(checkpoint, config, device)
    seen: list[list] = []

    def recording(attend):
        def attend_and_record(q, k, v, mask=None):
            out = attend(q, k, v, mask)
            out.retain_grad()
            rep = q.shape[1] // k.shape[1]
            k, v = (t.detach().repeat_interleave(rep, dim=1) for t in (k, v))
            seen.append([q.detach(), k, v, out])
            return out
        return attend_and_record

    for m in model.modules():
        if isinstance(m, Attention):
            m.attend = recording(m.attend)
    captured = []
    for x, y in val.val_batches(cfg.micro_batch_size, cfg.seq_len, batches):
        seen.clear()
        _, loss = model(x.to(device), y.to(device))
        loss.backward()
        captured += [(q.double(), k.double(), v.double(), out.grad.double())
                     for q, k, v, out in seen]
    return captured


def capture_hf(name: str, tokens: int, device: str = "cpu") -> list[tuple[torch.Tensor, ...]]:
    """(q, k, v, dO) in float64 at every attention layer of a pretrained Hugging Face causal LM
    (`fp4stack analyze`'s models: smollm2, or a model directory) on `tokens` tokens of real
    text, dO from its LM loss: q and k after RoPE, as the model's attention function gets them,
    K/V heads repeated to the query heads. The scores are recomputed at the default 1/sqrt(d)."""
    import torch.nn.functional as F
    from transformers import AttentionInterface

    from fp4stack.analysis.sample_models import text_batch
    from fp4stack.models.hf import load

    lm = load(name)
    model = lm.model.to(device).eval()
    seen: list[list] = []

    def attend_and_record(module, query, key, value, attention_mask, scaling=None, **kwargs):
        rep = query.shape[1] // key.shape[1]
        key, value = (t.repeat_interleave(rep, dim=1) for t in (key, value))
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
        out.retain_grad()
        seen.append([query.detach(), key.detach(), value.detach(), out])
        return out.transpose(1, 2), None

    AttentionInterface.register("fp4stack-record", attend_and_record)
    model.set_attn_implementation("fp4stack-record")
    ids = text_batch(tokens, lm.tokenizer, getattr(model.config, "vocab_size", None)).to(device)
    model(input_ids=ids, labels=ids).loss.backward()
    return [(q.double(), k.double(), v.double(), out.grad.double()) for q, k, v, out in seen]


def exact(q, k, v, do):
    """Output and gradients of causal attention with nothing quantized (float64)."""
    return run(AttentionQuant.off(), q, k, v, do)


def own_forward(q, k, v, do, cfg: AttentionQuant | None = None):
    """Exact gradients of attention at the forward's quantized operands (what reuse keeps):
    Q̂, K̂ along d and V̂ along keys with cfg's specs (default: the method's); with rotate_qk,
    Q̂, K̂ of the rotated Q, K and their gradients rotated back."""
    cfg = cfg or AttentionQuant.paper()
    if rotates(cfg):
        q, k = rht(q), rht(k)
    qh, kh = (quantize_along(t, spec, -1, torch.float64) for t, spec in ((q, cfg.q), (k, cfg.k)))
    vh = quantize_along(v, cfg.v, -2, torch.float64)
    out, dq, dk, dv = exact(qh, kh, vh, do)
    if rotates(cfg):
        dq, dk = rht_inverse(dq), rht_inverse(dk)
    return out, dq, dk, dv


def rotates(cfg: AttentionQuant) -> bool:
    """Whether cfg rotates Q and K (AttentionAblation.rotate_qk) before quantizing them."""
    return cfg.ablation is not None and cfg.ablation.rotate_qk


def run(cfg: AttentionQuant, q, k, v, do, backend: str = "torch"):
    """(out, dq, dk, dv) of fp4_attention with `cfg`: the torch reference, or backend's."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fp4_attention(q, k, v, causal=True, config=cfg, backend=backend)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def has_own_forward(cfg: AttentionQuant) -> bool:
    """Whether the forward is attention on Q̂, K̂, V̂ (all three quantized, deterministically;
    P not): the configurations the "vs own forward" columns are defined for."""
    specs = (cfg.q, cfg.k, cfg.v)
    return None not in specs and cfg.p is None and \
        all(s.rounding != "stochastic" for s in specs)


def errors(cfg: AttentionQuant, sample, refs) -> list[float]:
    """Relative errors of cfg's (out, dq, dk, dv) against refs[0] (exact attention) and, where
    defined, of (dq, dk, dv) against the own forward: refs[1] (the method's specs), or
    computed here for other specs of Q, K, V (16x16 tiles)."""
    got = run(cfg, *sample)
    rel = [((a - b).norm() / b.norm()).item() for a, b in zip(got, refs[0], strict=True)]
    if has_own_forward(cfg):
        default = (cfg.q, cfg.k, cfg.v) == (NVFP4_RNE,) * 3 and not rotates(cfg)
        own = refs[1] if default else own_forward(*sample, cfg)
        rel += [((a - b).norm() / b.norm()).item()
                for a, b in zip(got[1:], own[1:], strict=True)]
    return rel


def flushed(samples) -> str:
    """The share of Q's and K's nonzero elements NVFP4 rounds to zero, in 16-blocks along d
    (as S = Q Kᵀ needs them), along the sequence (as dK and dQ do) and in 16x16 tiles."""
    def share(t, spec, dim):
        return ((quantize_along(t, spec, dim, t.dtype) == 0) & (t != 0)).double().mean()

    cells = [sum(share(s[i], spec, dim) for s in samples) / len(samples) for i in (0, 1)
             for spec, dim in ((NVFP4_RNE, -1), (NVFP4_RNE, -2), (NVFP4_TILES, -1))]
    cells += [sum(share(rht(s[i]), NVFP4_RNE, -1) for s in samples) / len(samples)
              for i in (0, 1)]
    return ("Rounded to zero: Q {:.1%} in blocks along d, {:.1%} along the sequence, {:.1%} in "
            "16x16 tiles; K {:.1%}, {:.1%} and {:.1%}. Rotated (rotate_qk), along d: Q {:.1%}, "
            "K {:.1%}.").format(*cells)


def table(samples, title: str) -> None:
    refs = [(exact(*s), own_forward(*s)) for s in samples]
    print(f"\n{title} ({len(samples)} attention calls). {flushed(samples)}\n")
    print("| quantized | out vs exact | dq vs exact | dk vs exact | dv vs exact | "
          "dq vs own forward | dk vs own forward | dv vs own forward |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, cfg in CONFIGS.items():
        torch.manual_seed(0)  # a stochastic row draws the same whichever rows ran before it
        rows = [errors(cfg, s, r) for s, r in zip(samples, refs, strict=True)]
        means = [f"{sum(col) / len(col):.2e}" for col in zip(*rows, strict=True)]
        means += ["-"] * (7 - len(means))
        print(f"| {name} | " + " | ".join(means) + " |", flush=True)


KERNEL_CONFIGS = {name: CONFIGS[name] for name in (
    "Q, K, V, dS; reuse (default)", "Q, K, V, dS; no reuse",
    "Q, K, V; reuse (dS high precision)", "Q, K, V; no reuse (dS high precision)",
    "Q, K, V, dS; reuse V̂ only", "Q, K, V, dS; reuse Q̂, K̂ only",
    "Q, K, V, dS; reuse, re-blocked", "Q, K, V in 16x16 tiles, dS; reuse",
    "Q, K rotated; Q, K, V, dS; reuse", "Q, K rotated; Q, K, V, dS; no reuse",
    "Q, K, V, dS; high-precision backward")}


def kernel_table(samples) -> None:
    """The Triton kernels on the bf16-rounded samples (what training runs under autocast):
    their error against exact attention, and against the float64 reference of the same config
    on the same bf16 values (what the kernels add to the quantizers' error; with rotate_qk the
    torch reference on them, which rounds the rotated Q, K to bf16 as the kernels' path does)."""
    print(f"\nTriton kernels, bf16 inputs ({len(samples)} attention calls; relative error)\n")
    print("| quantized | out vs exact | dq vs exact | dk vs exact | dv vs exact | "
          "out vs reference | dq vs reference | dk vs reference | dv vs reference |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    bf16 = [tuple(t.to(torch.bfloat16) for t in s) for s in samples]
    exacts = [exact(*(t.double() for t in s)) for s in bf16]
    for name, cfg in KERNEL_CONFIGS.items():
        rows = []
        for s, want in zip(bf16, exacts, strict=True):
            got = [t.double() for t in run(cfg, *s, backend="triton")]
            # rotate_qk rounds the rotated bf16 Q, K to bf16 before quantizing them; the
            # reference on the same bf16 values does too, the float64 one would not
            ref = [t.double() for t in run(cfg, *s)] if rotates(cfg) else \
                run(cfg, *(t.double() for t in s))
            rows.append([((a - b).norm() / b.norm()).item()
                         for b_set in (want, ref) for a, b in zip(got, b_set, strict=True)])
        means = [f"{sum(col) / len(col):.2e}" for col in zip(*rows, strict=True)]
        print(f"| {name} | " + " | ".join(means) + " |", flush=True)


WEIGHT_GRAD_CONFIGS = {name: CONFIGS[name] for name in (
    "Q, K, V, dS; reuse (default)", "Q, K, V, dS; no reuse",
    "Q, K, V; reuse (dS high precision)", "Q, K, V; no reuse (dS high precision)",
    "Q, K, V, dS; reuse, re-blocked", "Q, K, V in 16x16 tiles, dS; reuse",
    "Q, K rotated; Q, K, V, dS; reuse", "Q, K rotated; Q, K, V, dS; no reuse",
    "Q, K, V, dS; high-precision backward",
    "Q, K, V, dS; no reuse, fresh stochastic rounding in the forward's dims",
    "Q, K, V, dS; no reuse, stochastic rounding", "Q, K, V stochastically rounded, dS; reuse",
    "Q, K, V stochastically rounded, dS; no reuse", "Q, K, V, dS; no reuse, delta from dP")}


def weight_grads(checkpoint: Path, config: str, batches: int, attention: AttentionQuant,
                 device: str = "cpu") -> list[dict[str, torch.Tensor]]:
    """Per training batch (micro-batch sized), the float64 gradients of every parameter of the
    checkpoint's GPT with its attention blocks running fp4_attention(config=attention)."""
    cfg, train, _, model = load_model(checkpoint, config, device)
    use_fp4_attention(model.double(), attention, backend="torch")
    grads = []
    for step in range(batches):
        x, y = train.train_batch(step, cfg.micro_batch_size, cfg.seq_len, seed=cfg.seed)
        model.zero_grad(set_to_none=True)
        _, loss = model(x.to(device), y.to(device))
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    return grads


def weight_grad_table(checkpoint: Path, config: str, batches: int, device: str) -> None:
    """Relative error of the attention projections' weight gradients against exact attention's:
    per batch (mean over batches), and of their sum over the batches; and for all parameters'
    summed gradient, its cosine with exact attention's and its gain along it, <g, e> / <e, e>
    (below 1: a step along g descends less than exact attention's would). Two per-coordinate
    columns, as Adam sees a gradient rather than as its norm does: the share of coordinates
    whose summed gradient has exact attention's sign, and the relative error of the summed
    gradient divided coordinate-wise by the RMS of its per-batch values (Adam's m / sqrt(v))."""
    exact_grads = weight_grads(checkpoint, config, batches, AttentionQuant.off(), device)
    groups = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o"}

    def rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        num = sum(((x - y) ** 2).sum() for x, y in zip(a, b, strict=True))
        return float((num / sum((y**2).sum() for y in b)).sqrt())

    def dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return float(sum((x * y).sum() for x, y in zip(a, b, strict=True)))

    print(f"\nWeight gradients of the attention projections ({batches} training batches; "
          "relative error against exact attention, all blocks together)\n")
    print("| quantized | " + " | ".join(f"W_{g} per batch | W_{g} summed" for g in
                                          groups.values()) +
          " | all params summed | cosine | gain | sign agreement | Adam-normalised |")
    print("|---|" + "---:|" * (2 * len(groups) + 5))
    every = list(exact_grads[0])
    want = [sum(e[n] for e in exact_grads) for n in every]
    want_adam = adam_normalised(exact_grads, every)
    for name, cfg in WEIGHT_GRAD_CONFIGS.items():
        torch.manual_seed(0)
        got = weight_grads(checkpoint, config, batches, cfg, device)
        cells = []
        for key in groups:
            names = [n for n in exact_grads[0] if key in n]
            per_batch = [rel([g[n] for n in names], [e[n] for n in names])
                         for g, e in zip(got, exact_grads, strict=True)]
            summed = rel([sum(g[n] for g in got) for n in names],
                         [sum(e[n] for e in exact_grads) for n in names])
            cells += [f"{sum(per_batch) / len(per_batch):.2e}", f"{summed:.2e}"]
        total = [sum(g[n] for g in got) for n in every]
        cosine = dot(total, want) / (dot(total, total) * dot(want, want)) ** 0.5
        gain = dot(total, want) / dot(want, want)
        signs = sum(((t.sign() == w.sign()) & (w != 0)).sum().item()
                    for t, w in zip(total, want, strict=True))
        signs /= sum((w != 0).sum().item() for w in want)
        adam = rel(adam_normalised(got, every), want_adam)
        print(f"| {name} | " + " | ".join(cells) +
              f" | {rel(total, want):.2e} | {cosine:.4f} | {gain:.4f} | {signs:.4f} | "
              f"{adam:.2e} |", flush=True)


def adam_normalised(grads: list[dict[str, torch.Tensor]], names: list[str]
                    ) -> list[torch.Tensor]:
    """Per parameter, the gradient summed over batches divided coordinate-wise by the RMS of
    the per-batch gradients (0 where they are all 0): the direction Adam would step along."""
    out = []
    for n in names:
        batch = torch.stack([g[n] for g in grads])
        rms = batch.pow(2).mean(0).sqrt()
        out.append(torch.where(rms > 0, batch.sum(0) / rms.clamp_min(1e-300), 0.0))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path,
                        help="a training checkpoint directory (model.safetensors)")
    source.add_argument("--model", help="instead, a pretrained Hugging Face causal LM: smollm2 "
                        "or a model directory (see fp4stack analyze)")
    p.add_argument("--tokens", type=int, default=512, help="--model: tokens of real text")
    p.add_argument("--config", default="configs/pretrain/tiny.yaml",
                   help="the pretraining config the checkpoint was trained with")
    p.add_argument("--batches", type=int, default=1, help="validation batches to capture")
    p.add_argument("--weight-grads", type=int, default=0, metavar="N",
                   help="also the weight-gradient table over N training batches")
    p.add_argument("--device", default="cpu", help="where to compute (float64), e.g. cuda")
    p.add_argument("--kernels", action="store_true",
                   help="also the Triton kernels' table on the real activations (CUDA)")
    p.add_argument("--only", nargs="+", metavar="TEXT",
                   help="only the settings whose name contains one of these (e.g. stochastic)")
    args = p.parse_args()
    if args.only:
        for configs in (CONFIGS, KERNEL_CONFIGS, WEIGHT_GRAD_CONFIGS):
            for name in [n for n in configs if not any(s in n for s in args.only)]:
                del configs[name]
        if not CONFIGS:
            p.error(f"--only {' '.join(args.only)} matches no setting")
    if args.model and args.weight_grads:
        p.error("--weight-grads needs --checkpoint (a GPT trained by fp4stack)")
    torch.manual_seed(0)
    if args.model:
        real = capture_hf(args.model, args.tokens, args.device)
    else:
        real = capture(args.checkpoint, args.config, args.batches, args.device)
    gauss = [tuple(torch.randn(t.shape, dtype=torch.float64, device=t.device) for t in s)
             for s in real]
    table(real, f"Real activations: {args.model or args.checkpoint}")
    if args.kernels:
        kernel_table(real)
    table(gauss, "Unit Gaussian q, k, v, dO of the same shapes")
    if args.weight_grads:
        weight_grad_table(args.checkpoint, args.config, args.weight_grads, args.device)


if __name__ == "__main__":
    main()
