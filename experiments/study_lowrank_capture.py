"""How much of a weight's NVFP4 error a rank-r branch can hold.

Full-Stack FP4's low-rank branch adds (x Aᵀ) Bᵀ with B A the best rank-r approximation of
W - Q(W) (fp4stack.nn.lowrank). Whatever it does in training, it can remove at most the share of
||W - Q(W)||² that the top r singular values carry. For every linear layer of a model this prints
that share per weight quantizer and rank, beside the same share for a Gaussian matrix of the
layer's shape (an error with no structure), and the weight-only relative error ||W - Q(W)|| / ||W||
before and after the branch. Beside it, the other way a rank-r BF16 branch can serve (SVDQuant's):
keep the top r singular directions L of W itself and quantize only W - L, error
||W - L - Q(W - L)|| / ||W||.

    python experiments/study_lowrank_capture.py --model smollm2 --ranks 16 64
"""

from __future__ import annotations

import argparse
import statistics

import torch

from fp4stack.api import fake_quantize
from fp4stack.formats.spec import QuantSpec
from fp4stack.models.hf import load

SPECS = {"1x16": QuantSpec(), "16x16": QuantSpec(block=(16, 16))}


def energy_shares(err: torch.Tensor, ranks: list[int]) -> list[float]:
    """Share of ||err||² in its top-r singular values, for each r (1.0 for r >= its rank)."""
    e = torch.linalg.svdvals(err.double()) ** 2
    total = float(e.sum())
    return [float(e[:r].sum()) / total if total else 1.0 for r in ranks]


def absorbed_errors(w: torch.Tensor, spec: QuantSpec, ranks: list[int],
                    svd: tuple[torch.Tensor, ...] | None = None) -> list[float]:
    """||W - L - Q(W - L)|| / ||W|| with L the best rank-r approximation of W, for each r.
    svd: torch.linalg.svd(W.double(), full_matrices=False), when the caller has it already."""
    u, s, vh = svd if svd is not None else torch.linalg.svd(w.double(), full_matrices=False)
    out = []
    for r in ranks:
        rest = (w.double() - (u[:, :r] * s[:r]) @ vh[:r]).float()
        out.append(float((rest - fake_quantize(rest, spec=spec)).norm() / w.norm()))
    return out


def layer_rows(model: torch.nn.Module, ranks: list[int], seed: int = 0) -> list[dict]:
    """One row per nn.Linear but the LM head: its name and shape, and per spec the weight's
    relative error, the energy shares of W - Q(W) and the error with W's top r directions
    absorbed; the Gaussian control's shares."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or name.endswith("lm_head"):
            continue
        w = mod.weight.detach().float()
        row = {"name": name, "shape": tuple(w.shape),
               "gaussian": energy_shares(torch.randn(w.shape, generator=g), ranks)}
        svd = torch.linalg.svd(w.double(), full_matrices=False)  # one per layer, for both specs
        for label, spec in SPECS.items():
            err = w - fake_quantize(w, spec=spec)
            row[label] = {"rel_error": float(err.norm() / w.norm()),
                          "shares": energy_shares(err, ranks),
                          "absorbed": absorbed_errors(w, spec, ranks, svd)}
        rows.append(row)
    return rows


def summary(rows: list[dict], ranks: list[int]) -> str:
    lines = ["| weights | rank | share of ‖W - Q(W)‖² held (mean, min..max) | Gaussian control | "
             "rel. error ‖W - Q(W)‖/‖W‖ -> after the branch | top r of W absorbed instead |",
             "|---|---:|---:|---:|---:|---:|"]
    for label in SPECS:
        for i, r in enumerate(ranks):
            shares = [row[label]["shares"][i] for row in rows]
            gauss = statistics.mean(row["gaussian"][i] for row in rows)
            before = statistics.mean(row[label]["rel_error"] for row in rows)
            after = statistics.mean(row[label]["rel_error"] * (1 - row[label]["shares"][i]) ** 0.5
                                    for row in rows)
            absorbed = statistics.mean(row[label]["absorbed"][i] for row in rows)
            lines.append(f"| {label} | {r} | {statistics.mean(shares):.3f} ({min(shares):.3f}.."
                         f"{max(shares):.3f}) | {gauss:.3f} | {before:.4f} -> {after:.4f} | "
                         f"{absorbed:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-dense",
                   help="tiny-dense, tiny-moe, smollm2 or a Hugging Face directory")
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    loaded = load(args.model, seed=args.seed)
    rows = layer_rows(loaded.model, args.ranks, args.seed)
    print(f"{loaded.description}: {len(rows)} linear layers")
    print(summary(rows, args.ranks))


if __name__ == "__main__":
    main()
