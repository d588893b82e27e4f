"""The Full-Stack FP4 paper's claims against `fp4stack compare` reports: paper / fp4stack.

Reads the compare.json of a pretraining comparison (configs/pretrain/small-docs.yaml's recipes,
several seeds) and prints a markdown table of the paper's claims (arXiv 2607.04422, as
docs/RESULTS.md quotes them) beside this comparison's numbers: each recipe's mean gap over its
seeds to the mean BF16 validation loss, with the gap's standard error, for the loss of the model
as trained (its FP4 forward, the paper's measure) and of the same weights evaluated with every
quantizer off. With --larger, the same recipes' gaps at a larger model, and whether they shrink.

    python experiments/fullstack_claims.py runs/compare/small-docs/compare.json \\
        [--larger runs/compare/base-docs/compare.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from claims_table import format_claims

from fp4stack.train.compare import RunRow, gap_standard_error

# The paper's numbers: gaps of the validation loss to BF16, in %.
PAPER = {"baseline": 1.40, "lowrank": 0.61, "all_1b": 0.62, "full_3b": 1.47}
DEFAULT_RUNS = {"bf16": "bf16", "bf16_optimizer": "bf16+root", "baseline": "nvfp4-4over6",
                "lowrank": "lowrank-svd-4over6", "attention": "nvfp4-4over6-attention",
                "full": "fullstack-paper+root4", "best": "fullstack-nvidia-noreuse"}


def _runs(rows: list[RunRow], recipe: str) -> list[RunRow]:
    runs = [r for r in rows if r.recipe == recipe]
    if not runs:
        raise KeyError(f"the comparison has no {recipe!r} run (recipes: "
                       f"{sorted({r.recipe for r in rows})})")
    return runs


def gap(rows: list[RunRow], recipe: str, base: str = "bf16",
        unquantized: bool = False) -> tuple[float, float | None]:
    """(mean gap of `recipe` to `base` over their seeds in %, its standard error or None).
    unquantized: `recipe`'s weights evaluated with every quantizer off."""
    runs, base_runs = _runs(rows, recipe), _runs(rows, base)
    if unquantized:
        if any(r.val_loss_high_precision is None for r in runs):
            raise KeyError(f"{recipe!r} has runs without an unquantized evaluation")
        runs = [RunRow(**{**r.__dict__, "val_loss": r.val_loss_high_precision}) for r in runs]
    ref = statistics.fmean(r.val_loss for r in base_runs)
    mean = statistics.fmean(r.val_loss for r in runs)
    return 100.0 * (mean - ref) / ref, gap_standard_error(runs, base_runs)


def _fmt(g: tuple[float, float | None]) -> str:
    return f"{g[0]:+.2f}%" + ("" if g[1] is None else f" ± {g[1]:.2f}")


def _both(rows: list[RunRow], recipe: str, base: str = "bf16") -> str:
    """The FP4-forward gap, then the unquantized one where the runs recorded it."""
    text = _fmt(gap(rows, recipe, base))
    if all(r.val_loss_high_precision is not None for r in _runs(rows, recipe)):
        text += f" (unquantized {_fmt(gap(rows, recipe, base, unquantized=True))})"
    return text


def _seeds(rows: list[RunRow], *recipes: str) -> str:
    return "/".join(str(len(_runs(rows, r))) for r in recipes)


def claims(rows: list[RunRow], names: dict[str, str] | None = None,
           larger: list[RunRow] | None = None) -> list[dict[str, Any]]:
    """The claims as rows {claim, paper, here, holds}; holds is None where the paper sets no
    target. KeyError names a missing run."""
    n = {**DEFAULT_RUNS, **(names or {})}
    base, low = gap(rows, n["baseline"])[0], gap(rows, n["lowrank"])[0]
    full = gap(rows, n["full"])[0]
    attention = gap(rows, n["attention"])[0] - base
    out = [
        {"claim": f"{n['lowrank']}'s gap at most half of {n['baseline']}'s "
                  f"(seeds {_seeds(rows, n['bf16'], n['baseline'], n['lowrank'])})",
         "paper": f"{PAPER['baseline']:.2f}% -> {PAPER['lowrank']:.2f}% (1B, 20B tokens)",
         "here": f"{_both(rows, n['baseline'])} -> {_both(rows, n['lowrank'])}",
         "holds": base > 0 and low <= base / 2},
        {"claim": f"the paper's full stack ({n['full']}) at most 1.0% over BF16",
         "paper": f"{PAPER['all_1b']:.2f}% (1B), {PAPER['full_3b']:.2f}% (3B, 64B tokens)",
         "here": _both(rows, n["full"]), "holds": full <= 1.0},
        {"claim": f"the paper's attention (Q, K, dS in NVFP4) on the {n['baseline']} linears",
         "paper": "part of the full stack's gap; not reported alone",
         "here": f"{_both(rows, n['attention'])}: {attention:+.2f} points over "
                 f"{n['baseline']}", "holds": None},
        {"claim": f"fp4stack's best full stack ({n['best']})", "paper": "-",
         "here": _both(rows, n["best"]), "holds": None},
    ]
    if any(r.recipe == n["bf16_optimizer"] for r in rows):
        out.insert(2, {"claim": f"{n['full']} against {n['bf16_optimizer']} (BF16 with the "
                                "same optimizer)", "paper": "-",
                       "here": _both(rows, n["full"], n["bf16_optimizer"]),
                       "holds": gap(rows, n["full"], n["bf16_optimizer"])[0] <= 1.0})
    if larger is not None:
        for key in ("baseline", "lowrank", "full", "best"):
            if not any(r.recipe == n[key] for r in larger):
                continue
            small, big = gap(rows, n[key])[0], gap(larger, n[key])[0]
            out.append({"claim": f"{n[key]}'s gap shrinks at the larger model",
                        "paper": "0.62% (1B, 20B tokens) -> 1.47% (3B, 64B)" if key == "full"
                                 else "not reported",
                        "here": f"{_fmt(gap(rows, n[key]))} -> {_fmt(gap(larger, n[key]))}",
                        "holds": big < small})
    return out


def load(path: Path) -> list[RunRow]:
    return [RunRow(**r) for r in json.loads(path.read_text())]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", type=Path, help="a `fp4stack compare` compare.json")
    p.add_argument("--larger", type=Path, help="the same recipes' compare.json at a larger model")
    for key, default in DEFAULT_RUNS.items():
        p.add_argument(f"--{key.replace('_', '-')}", default=default,
                       help=f"the recipe in that role (default {default})")
    args = p.parse_args(argv)
    names = {key: getattr(args, key) for key in DEFAULT_RUNS}
    try:
        table = claims(load(args.report), names, load(args.larger) if args.larger else None)
    except (KeyError, FileNotFoundError) as e:
        print(f"fullstack_claims: {e}", file=sys.stderr)
        return 2
    print(format_claims(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
