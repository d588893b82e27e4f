"""The QUADS paper's claims against an `rl-compare` report: paper / fp4stack, claim by claim.

Reads the rl_compare.json of a comparison (one `rl-compare`, or several merged with
`rl-compare --report-from`) and prints a markdown table of the paper's claims (arXiv
2607.15810, as docs/results/rl.md quotes them) beside this comparison's numbers, each with
whether it holds here. The runs it looks for are named as rl-compare names them: bf16, nvfp4,
and the QUADS arm given by --quads (default: of the quads@F runs, the one whose mean final
pass@1 over its seeds is highest).

    python experiments/quads_claims.py runs/rl-compare/all/rl_compare.json [--quads quads@0.5]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from claims_table import format_claims

from fp4stack.rl.compare_report import seed_summary

# The paper's numbers (average pass@1 in points, mismatch as the mean per-step max |dlogp|).
PAPER = {"bf16_pass": 73.15, "naive_pass": 51.37, "quads_pass": 72.86,
         "floor_dlogp": 0.74, "quads_dlogp": 0.86, "naive_dlogp": 1.3}


def claims(rows: list[dict[str, Any]], quads: str | None = None) -> list[dict[str, Any]]:
    """The claims as rows {claim, paper, here, holds}; KeyError naming a missing run."""
    summary = {s["run"]: s for s in seed_summary(rows)}
    for name in ("bf16", "nvfp4"):
        if name not in summary:
            raise KeyError(f"the comparison has no {name!r} run (runs: {sorted(summary)})")
    if quads is None:
        arms = [s for n, s in summary.items() if n.startswith("quads@")]
        if not arms:
            raise KeyError(f"the comparison has no quads@F run (runs: {sorted(summary)})")
        quads = max(arms, key=lambda s: s["pass_at_1"] or 0.0)["run"]
    elif quads not in summary:
        raise KeyError(f"the comparison has no {quads!r} run (runs: {sorted(summary)})")
    b, n, q = summary["bf16"], summary["nvfp4"], summary[quads]
    seeds = f"seeds {b['seeds']}/{n['seeds']}/{q['seeds']}"
    naive_gap = 100 * (b["pass_at_1"] - n["pass_at_1"])
    quads_gap = 100 * (b["pass_at_1"] - q["pass_at_1"])
    order = [b["dlogp_max_mean"], q["dlogp_max_mean"], n["dlogp_max_mean"]]
    k3_ratio = n["k3_mean"] / q["k3_mean"] if q["k3_mean"] > 0 else float("inf")
    return [
        {"claim": f"naive NVFP4 ends >= 5 points of pass@1 below BF16 ({seeds})",
         "paper": f"{PAPER['bf16_pass'] - PAPER['naive_pass']:.1f} points below",
         "here": f"{naive_gap:.1f} points below", "holds": naive_gap >= 5},
        {"claim": f"{quads} ends within 1 point of BF16's pass@1",
         "paper": f"{PAPER['bf16_pass'] - PAPER['quads_pass']:.2f} points below",
         "here": f"{quads_gap:.1f} points below", "holds": abs(quads_gap) <= 1},
        {"claim": "mean per-step max abs dlogp: BF16 < QUADS < naive",
         "paper": f"{PAPER['floor_dlogp']} < {PAPER['quads_dlogp']} < {PAPER['naive_dlogp']}",
         "here": " < ".join(f"{v:.3f}" for v in order),
         "holds": order[0] < order[1] < order[2]},
        {"claim": "QUADS's mean k3 at least 3x below naive's", "paper": "not reported",
         "here": f"{k3_ratio:.2f}x below", "holds": k3_ratio >= 3},
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", type=Path, help="an rl-compare rl_compare.json")
    p.add_argument("--quads", help="the QUADS arm (default: the quads@F run with the best pass@1)")
    args = p.parse_args(argv)
    try:
        table = claims(json.loads(args.report.read_text()), args.quads)
    except (KeyError, FileNotFoundError) as e:
        print(f"quads_claims: {e}", file=sys.stderr)
        return 2
    print(format_claims(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
