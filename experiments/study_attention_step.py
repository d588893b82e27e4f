"""One optimizer step along each attention setting's gradient: how much each lowers the loss.

study_attention_quantization.py measures how far each setting's gradients are from exact
attention's. This asks the question training asks instead: starting from one checkpoint, take
one Adam-like step (m / sqrt(v) over N training batches, times lr) along the gradient each
setting gives, and measure the validation loss after it, with the forward the trained model
runs (the method's FP4 attention: Q, K, V in NVFP4, round to nearest; linears exact) and with
exact attention. Every setting starts from the same weights and is evaluated on the same
validation windows, in float64, so the differences between settings are the gradients' alone.

    python experiments/study_attention_step.py \
        --checkpoint runs/compare/tiny-attention/bf16-s0/checkpoints/step_00000200 \
        --config configs/pretrain/tiny.yaml --batches 32 --lr 3e-5 1e-4 3e-4
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from study_attention_quantization import CONFIGS, adam_normalised, load_model, weight_grads

from fp4stack.nn.attention import AttentionQuant, use_fp4_attention

# The attention study's settings of the same names, after exact attention's own gradient.
SETTINGS = {"exact attention": AttentionQuant.off(), **{name: CONFIGS[name] for name in (
    "Q, K, V, dS; reuse (default)", "Q, K, V, dS; no reuse", "Q, K, V, dS; reuse, re-blocked",
    "Q, K, V, dS; no reuse, fresh stochastic rounding in the forward's dims",
    "Q, K, V, dS; no reuse, stochastic rounding")}}


@torch.no_grad()
def val_loss(model, windows) -> float:
    """Mean loss over the validation windows (the same ones for every call)."""
    return sum(float(model(x, y)[1]) for x, y in windows) / len(windows)


def adam_direction(grads: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """m / sqrt(v) of the per-batch gradients, per coordinate: the direction of Adam's first
    step from zeroed moments with these batches accumulated (bias-corrected, no epsilon)."""
    names = list(grads[0])
    return dict(zip(names, (d / len(grads) for d in adam_normalised(grads, names)), strict=True))


def step_table(checkpoint: Path, config: str, batches: int, lrs: list[float],
               device: str = "cpu") -> list[list[float]]:
    """Prints the table; returns its rows' numbers: the step norm relative to exact attention's,
    then per lr the loss change with the FP4 forward and with the exact one."""
    cfg, _, val, model = load_model(checkpoint, config, device)
    model.double().eval()
    windows = [(x.to(device), y.to(device))
               for x, y in val.val_batches(cfg.micro_batch_size, cfg.seq_len, cfg.eval_batches)]
    start = {n: t.detach().clone() for n, t in model.named_parameters()}
    forwards = {"FP4 forward": AttentionQuant.paper(), "exact forward": AttentionQuant.off()}
    before = {}
    for label, fwd in forwards.items():
        use_fp4_attention(model, fwd, backend="torch")
        before[label] = val_loss(model, windows)
    print(f"\nValidation loss at the checkpoint: FP4 forward {before['FP4 forward']:.6f}, "
          f"exact forward {before['exact forward']:.6f} ({len(windows)} windows)\n")
    cols = [f"{label}, lr {lr:g}" for lr in lrs for label in forwards]
    print("| gradient from | step norm / exact's | " +
          " | ".join(f"change, {c}" for c in cols) + " |")
    print("|---|---:|" + "---:|" * len(cols))
    rows, exact_norm = [], None
    for name, setting in SETTINGS.items():
        torch.manual_seed(0)  # a stochastic setting draws the same whichever settings ran
        direction = adam_direction(weight_grads(checkpoint, config, batches, setting, device))
        norm = float(sum((d**2).sum() for d in direction.values()).sqrt())
        exact_norm = exact_norm or norm  # the first setting is exact attention
        row = [norm / exact_norm]
        for lr in lrs:
            with torch.no_grad():
                for n, t in model.named_parameters():
                    t.copy_(start[n] - lr * direction[n])
            for label, fwd in forwards.items():
                use_fp4_attention(model, fwd, backend="torch")
                row.append(val_loss(model, windows) - before[label])
        rows.append(row)
        print(f"| {name} | {row[0]:.4f} | " + " | ".join(f"{c:+.6f}" for c in row[1:]) + " |",
              flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, required=True,
                   help="a training checkpoint directory (model.safetensors)")
    p.add_argument("--config", default="configs/pretrain/tiny.yaml",
                   help="the pretraining config the checkpoint was trained with")
    p.add_argument("--batches", type=int, default=32, help="training batches per gradient")
    p.add_argument("--lr", type=float, nargs="+", default=[3e-5, 1e-4, 3e-4],
                   help="step sizes")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    step_table(args.checkpoint, args.config, args.batches, args.lr, args.device)


if __name__ == "__main__":
    main()
