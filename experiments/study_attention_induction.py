"""Which attention settings train stably once attention is sharp: an induction (copy) task.

The `small` comparison trains a language model whose loss stays near 3, where attention is
diffuse. Here a 2-block GPT learns to copy: each sequence is 32 random tokens repeated once,
and the loss is taken on the repeat, which an induction head predicts almost exactly. Within
a few dozen steps the loss falls near 0 and attention becomes nearly one-hot, the regime
where a backward that is not the forward's gradient can push the scores the wrong way. Every
setting trains from the same initialisation on the same batches (per seed), linears exact,
only fp4_attention's setting differs (torch reference). The final loss is measured with the
method's FP4 forward on held-out sequences; the curves are the training loss.

    python experiments/study_attention_induction.py --steps 200 --seeds 0 1 2 \
        --plot docs/attention_induction.png

At other sizes, and on a GPU through the Triton kernels where they compute the setting (bf16
autocast, the way the trainer runs them; the others fall back to the torch reference):

    python experiments/study_attention_induction.py --device cuda --dim 512 --layers 4 \
        --heads 8 --seq 1024 --batch 16 --only "reuse (default)" "no reuse"
"""

from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from plots import curves_axes, save_curves

from fp4stack.models import GPT, GPTConfig
from fp4stack.nn.attention import NVFP4_SR, AttentionQuant, use_fp4_attention
from fp4stack.nn.attention_ablation import AttentionAblation

# The settings with the ablation's fields written flat, e.g. ablated(reuse=("v",)).
ablated = AttentionAblation.quant
SETTINGS = {
    "exact attention": AttentionQuant.off(),
    "reuse (default)": AttentionQuant.paper(),
    "reuse V̂ only": ablated(reuse=("v",)),
    "reuse, re-blocked": ablated(reblock=True),
    "Q, K, V stochastically rounded; reuse": AttentionQuant(q=NVFP4_SR, k=NVFP4_SR, v=NVFP4_SR),
    "reuse Q̂, K̂ only": ablated(reuse=("q", "k")),
    "no reuse": AttentionQuant(reuse=False),
    "no reuse, stochastic rounding": ablated(reuse=False, requantize_rounding="stochastic"),
    "no reuse, fresh stochastic rounding in the forward's dims": ablated(
        reuse=False, requantize_along="forward", requantize_rounding="stochastic"),
    "Q, K, V stochastically rounded; no reuse": AttentionQuant(
        q=NVFP4_SR, k=NVFP4_SR, v=NVFP4_SR, reuse=False),
    "high-precision backward": ablated(reuse=False, requantize=False),
    # dS = P ∘ (dP - rowsum(P ∘ dP)): the softmax's gradient of the backward's own dP, so a
    # V operand other than V̂ no longer leaves each row of dS a non-zero sum.
    "no reuse; delta from dP": ablated(reuse=False, delta="dp"),
    "reuse Q̂, K̂ only; delta from dP": ablated(reuse=("q", "k"), delta="dp"),
    "Q, K, V stochastically rounded; no reuse; delta from dP": ablated(
        q=NVFP4_SR, k=NVFP4_SR, v=NVFP4_SR, reuse=False, delta="dp"),
    "high-precision backward; delta from dP": ablated(reuse=False, requantize=False,
                                                      delta="dp"),
}
VOCAB = 64


@dataclass(frozen=True)
class Task:
    """The model and the copy task's shape; the defaults are the CPU study's."""

    dim: int = 64
    layers: int = 2
    heads: int = 4
    seq: int = 64
    batch: int = 32
    device: str = "cpu"

    def model(self) -> GPT:
        return GPT(GPTConfig(vocab_size=VOCAB, dim=self.dim, n_layers=self.layers,
                             n_heads=self.heads, n_kv_heads=self.heads, ffn_hidden=2 * self.dim,
                             max_seq_len=self.seq, qk_norm=False)).to(self.device)

    def batch_of(self, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets): seq/2 random tokens then the same again, shifted by one."""
        half = torch.randint(0, VOCAB, (self.batch, self.seq // 2), generator=g)
        x = torch.cat([half, half], 1).to(self.device)
        return x[:, :-1], x[:, 1:]

    def autocast(self):
        cuda = self.device.startswith("cuda")
        return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()


def repeat_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the repeated half, where the tokens are predictable."""
    logits, _ = model(x)
    half = (x.shape[1] + 1) // 2
    return F.cross_entropy(logits[:, half:].float().reshape(-1, VOCAB), y[:, half:].reshape(-1))


def train(setting: AttentionQuant, seed: int, steps: int, task: Task = Task(),
          lr: float = 3e-3) -> tuple[list[float], float]:
    """Training losses per step and the final held-out loss with the method's FP4 forward.
    On CUDA the attention runs the kernels where they compute `setting` (backend auto)."""
    backend = "torch" if task.device == "cpu" else "auto"
    torch.manual_seed(seed)  # the same initialisation (and stochastic draws) for every setting
    model = task.model()
    use_fp4_attention(model, setting, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(1000 + seed)
    losses = []
    for _ in range(steps):
        with task.autocast():
            loss = repeat_loss(model, *task.batch_of(g))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    use_fp4_attention(model, AttentionQuant.paper(), backend=backend)
    held_out = torch.Generator().manual_seed(99)
    with torch.no_grad(), task.autocast():
        final = sum(repeat_loss(model, *task.batch_of(held_out)).item() for _ in range(4)) / 4
    return losses, final


def select(only: list[str], exact: bool = False) -> dict[str, AttentionQuant]:
    """The settings named in `only` (all when empty): by their full name with exact=True,
    else every setting whose name contains one of the texts."""
    return {n: c for n, c in SETTINGS.items()
            if not only or (n in only if exact else any(s in n for s in only))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--plot", help="write the training curves (mean over seeds) to this PNG")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    p.add_argument("--only", nargs="+", metavar="TEXT",
                   help="only the settings whose name contains one of these")
    p.add_argument("--exact", action="store_true",
                   help="--only names settings in full (\"no reuse\" alone, not every setting "
                   "whose name contains it)")
    for field in fields(Task):
        p.add_argument(f"--{field.name}", type=type(field.default), default=field.default)
    args = p.parse_args()
    task = Task(**{f.name: getattr(args, f.name) for f in fields(Task)})
    settings = select(args.only or [], exact=args.exact)
    if not settings:
        p.error(f"--only {' '.join(args.only)} matches no setting")
    marks = [s for s in (25, 50, 100, 150, 200, 300, 400) if s <= args.steps]
    print(f"\nCopy task ({task}), {args.steps} steps, seeds {args.seeds}: final held-out loss (FP4 "
          "forward) per seed; training loss (mean over seeds, 10 steps) at steps "
          f"{', '.join(map(str, marks))}\n")
    cols = [f"s{s}" for s in args.seeds] + [f"step {m}" for m in marks]
    print("| attention setting | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * (len(args.seeds) + len(marks)))
    curves = {}
    for name, setting in settings.items():
        t0 = time.perf_counter()
        runs = [train(setting, seed, args.steps, task, args.lr) for seed in args.seeds]
        mean = [sum(r[0][i] for r in runs) / len(runs) for i in range(args.steps)]
        curves[name] = mean
        at = [sum(mean[m - 10:m]) / 10 for m in marks]
        cells = [f"{r[1]:.4f}" for r in runs] + [f"{v:.3f}" for v in at]
        print(f"| {name} | " + " | ".join(cells) + f" |  ({time.perf_counter() - t0:.0f} s)",
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
