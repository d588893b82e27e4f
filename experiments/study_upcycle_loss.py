"""How much of a pretrained model survives upcycling to a mixture of experts, before training.

Loads SmolLM2-135M-Instruct (or any `fp4stack.models.hf.load` name) into fp4stack's GPT and
prints the mean next-token loss of a few short texts for the dense model, for split upcycling
(each expert a slice of the MLP's hidden units) and for copy upcycling with per-copy noise, at
the given top-k. Answers which upcycling an RL policy should start from (docs/results/rl.md).

    FP4STACK_SMOLLM2_GGUF=SmolLM2-135M-Instruct.Q4_1.gguf \\
        python experiments/study_upcycle_loss.py --experts 8 --top-k 2,4 --noise 0,0.01,0.05
"""

from __future__ import annotations

import argparse
import json

import torch

from fp4stack.models import hf
from fp4stack.models.hf_import import gpt_from_hf
from fp4stack.models.upcycle import upcycle_gpt

TEXTS = (
    "The capital of France is Paris. It is known for the Eiffel Tower and its museums, cafes "
    "and long history.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5",
    "Question: What is 12 + 7? Answer: 12 + 7 = 19.",
)


def mean_loss(model: torch.nn.Module, token_ids: list[list[int]]) -> float:
    """Mean over the texts of the model's next-token cross-entropy (nats per token)."""
    losses = []
    with torch.no_grad():
        for ids in token_ids:
            t = torch.tensor([ids])
            losses.append(model(t[:, :-1], t[:, 1:])[1].item())
    return sum(losses) / len(losses)


def study(model: torch.nn.Module, token_ids: list[list[int]], experts: int,
          top_ks: list[int], noises: list[float]) -> list[dict]:
    """Rows of (how, top_k, noise, loss) for the dense model and each upcycling."""
    rows = [dict(how="dense", top_k=None, noise=None, loss=mean_loss(model, token_ids))]
    for k in top_ks:
        split = upcycle_gpt(model, experts, k, split=True).eval()
        rows.append(dict(how="split", top_k=k, noise=None, loss=mean_loss(split, token_ids)))
        for noise in noises:
            copies = upcycle_gpt(model, experts, k, expert_noise=noise).eval()
            rows.append(dict(how="copies", top_k=k, noise=noise,
                             loss=mean_loss(copies, token_ids)))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", default="2,4")
    p.add_argument("--noise", default="0,0.01,0.05")
    p.add_argument("--out", help="also write the rows as JSON here")
    args = p.parse_args()
    loaded = hf.load(args.model)
    model = gpt_from_hf(loaded.model).eval()
    token_ids = [loaded.tokenizer.encode(t) for t in TEXTS]
    rows = study(model, token_ids, args.experts, [int(k) for k in args.top_k.split(",")],
                 [float(x) for x in args.noise.split(",")])
    print(f"{loaded.description}, {args.experts} experts; mean loss of {len(TEXTS)} texts")
    print("| upcycling | top-k | noise | loss (nats/token) |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['how']} | {r['top_k'] or ''} | {'' if r['noise'] is None else r['noise']} "
              f"| {r['loss']:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": loaded.description, "experts": args.experts, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
