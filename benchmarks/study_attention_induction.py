"""Which attention settings train stably once attention is sharp: an induction (copy) task.

The `small` comparison trains a language model whose loss stays near 3, where attention is
diffuse. Here a 2-block GPT learns to copy: each sequence is 32 random tokens repeated once,
and the loss is taken on the repeat, which an induction head predicts almost exactly. Within
a few dozen steps the loss falls near 0 and attention becomes nearly one-hot, the regime
where a backward that is not the forward's gradient can push the scores the wrong way. Every
setting trains from the same initialisation on the same batches (per seed), linears exact,
only fp4_attention's setting differs (torch reference). The final loss is measured with the
method's FP4 forward on held-out sequences; the curves are the training loss.

    python benchmarks/study_attention_induction.py --steps 200 --seeds 0 1 2 \
        --plot docs/attention_induction.png
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from plots import curves_axes, save_curves

from fp4stack.models import GPT, GPTConfig
from fp4stack.nn.attention import NVFP4_SR, AttentionQuant, use_fp4_attention

SETTINGS = {
    "exact attention": AttentionQuant.off(),
    "reuse (default)": AttentionQuant.paper(),
    "reuse V̂ only": AttentionQuant(reuse=("v",)),
    "reuse, re-blocked": AttentionQuant(reblock=True),
    "Q, K, V stochastically rounded; reuse": AttentionQuant(q=NVFP4_SR, k=NVFP4_SR, v=NVFP4_SR),
    "reuse Q̂, K̂ only": AttentionQuant(reuse=("q", "k")),
    "no reuse": AttentionQuant(reuse=False),
    "no reuse, stochastic rounding": AttentionQuant(reuse=False,
                                                    requantize_rounding="stochastic"),
    "no reuse, fresh stochastic rounding in the forward's dims": AttentionQuant(
        reuse=False, requantize_along="forward", requantize_rounding="stochastic"),
    "Q, K, V stochastically rounded; no reuse": AttentionQuant(
        q=NVFP4_SR, k=NVFP4_SR, v=NVFP4_SR, reuse=False),
    "high-precision backward": AttentionQuant(reuse=False, requantize=False),
    # dS = P ∘ (dP - rowsum(P ∘ dP)): the softmax's gradient of the backward's own dP, so a
    # V operand other than V̂ no longer leaves each row of dS a non-zero sum.
    "no reuse; delta from dP": AttentionQuant(reuse=False, delta="dp"),
    "reuse Q̂, K̂ only; delta from dP": AttentionQuant(reuse=("q", "k"), delta="dp"),
    "Q, K, V stochastically rounded; no reuse; delta from dP": AttentionQuant(
        q=NVFP4_SR, k=NVFP4_SR, v=NVFP4_SR, reuse=False, delta="dp"),
    "high-precision backward; delta from dP": AttentionQuant(reuse=False, requantize=False,
                                                             delta="dp"),
}
VOCAB, SEQ, BATCH = 64, 64, 32


def copy_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets): 32 random tokens then the same 32 again, shifted by one."""
    half = torch.randint(0, VOCAB, (BATCH, SEQ // 2), generator=g)
    x = torch.cat([half, half], 1)
    return x[:, :-1], x[:, 1:]


def repeat_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the repeated half, where the tokens are predictable."""
    logits, _ = model(x)
    return F.cross_entropy(logits[:, SEQ // 2:].reshape(-1, VOCAB), y[:, SEQ // 2:].reshape(-1))


def train(setting: AttentionQuant, seed: int, steps: int, lr: float = 3e-3
          ) -> tuple[list[float], float]:
    """Training losses per step and the final held-out loss with the method's FP4 forward."""
    torch.manual_seed(seed)  # the same initialisation (and stochastic draws) for every setting
    model = GPT(GPTConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=4,
                          ffn_hidden=128, max_seq_len=SEQ, qk_norm=False))
    use_fp4_attention(model, setting, backend="torch")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(1000 + seed)
    losses = []
    for _ in range(steps):
        loss = repeat_loss(model, *copy_batch(g))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    use_fp4_attention(model, AttentionQuant.paper(), backend="torch")
    held_out = torch.Generator().manual_seed(99)
    with torch.no_grad():
        final = sum(repeat_loss(model, *copy_batch(held_out)).item() for _ in range(4)) / 4
    return losses, final


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--plot", help="write the training curves (mean over seeds) to this PNG")
    args = p.parse_args()
    marks = [s for s in (25, 50, 100, 150, 200, 300, 400) if s <= args.steps]
    print(f"\nCopy task, {args.steps} steps, seeds {args.seeds}: final held-out loss (FP4 "
          "forward) per seed; training loss (mean over seeds, 10 steps) at steps "
          f"{', '.join(map(str, marks))}\n")
    print("| attention setting | " + " | ".join(f"s{s}" for s in args.seeds) + " | " +
          " | ".join(f"step {m}" for m in marks) + " |")
    print("|---|" + "---:|" * (len(args.seeds) + len(marks)))
    curves = {}
    for name, setting in SETTINGS.items():
        t0 = time.perf_counter()
        runs = [train(setting, seed, args.steps) for seed in args.seeds]
        mean = [sum(r[0][i] for r in runs) / len(runs) for i in range(args.steps)]
        curves[name] = mean
        at = [sum(mean[m - 10:m]) / 10 for m in marks]
        print(f"| {name} | " + " | ".join(f"{r[1]:.4f}" for r in runs) + " | " +
              " | ".join(f"{v:.3f}" for v in at) + f" |  ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    if args.plot:
        fig, ax = curves_axes(len(curves))
        for i, (name, mean) in enumerate(curves.items()):
            smooth = [sum(mean[max(0, j - 9):j + 1]) / len(mean[max(0, j - 9):j + 1])
                      for j in range(len(mean))]
            ax.plot(range(1, len(mean) + 1), smooth, label=name, color=f"C{i % 10}",
                    linestyle=("-", "--", ":")[min(i // 5, 2)])
        ax.set_yscale("log")
        save_curves(fig, ax, args.plot, xlabel="step",
                    ylabel="loss on the repeat (seed mean, 10-step avg)",
                    title="Copy task: which FP4 attention backward stays stable")


if __name__ == "__main__":
    main()
