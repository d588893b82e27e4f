"""The QUADS paper's claims against an `rl-compare` report: paper / fp4stack, claim by claim.

Reads the rl_compare.json of a comparison (one `rl-compare`, or several merged with
`rl-compare --report-from`) and prints a markdown table of the paper's claims (arXiv
2607.15810, as docs/results/rl.md quotes them) beside this comparison's numbers, each with
whether it holds here. The runs it looks for are named as rl-compare names them: bf16, nvfp4,
and the QUADS arm given by --quads (default: of the quads@F runs, the one whose mean final
pass@1 over its seeds is highest); with quads@F runs at two or more ratios, also whether the
mismatch falls as the ratio grows, as the paper's ratio sweep found; with a w4a16 run, whether
the QUADS arm ends at or above it, as the paper's W4A16 ablation found. Arms are compared over the
seeds they share (each seed's runs start from that seed's warm-up), so an arm with more seeds
than another does not move a gap by its extra seeds' spread.

    python experiments/quads_claims.py runs/rl-compare/all/rl_compare.json [--quads quads@0.5]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from claims_table import format_claims

from fp4stack.rl.compare import parse_run
from fp4stack.rl.compare_report import seed_summary

# The paper's numbers (average pass@1 in points, mismatch as the mean per-step max |dlogp|).
PAPER = {"bf16_pass": 73.15, "naive_pass": 51.37, "quads_pass": 72.86,
         "floor_dlogp": 0.74, "quads_dlogp": 0.86, "naive_dlogp": 1.3,
         "w4a16_pass": 71.1, "w4a16_compensated_pass": 72.9}  # the W4A16 QAT ablation
# The paper's max |dlogp| gap per compensated-channel ratio.
PAPER_RATIOS = {0.125: 0.923, 0.25: 0.901, 0.5: 0.854, 0.75: 0.812, 1.0: 0.759}


def shared_seeds(rows: list[dict[str, Any]], runs: list[str]) -> list[int]:
    """The seeds every one of `runs` has a row for, sorted; ValueError naming the runs when
    they share none (then they are no comparison)."""
    common = None
    for name in runs:
        own = {r["seed"] for r in rows if r["run"] == name}
        common = own if common is None else common & own
    if not common:
        raise ValueError(f"{', '.join(runs)} share no seed: each seed's runs start from its own "
                         "warm-up, so arms are compared over the seeds they have in common")
    return sorted(common)


def paired_summary(rows: list[dict[str, Any]], runs: list[str]
                   ) -> tuple[list[int], dict[str, dict[str, Any]]]:
    """The seeds `runs` share, and seed_summary's row of each run over those seeds only."""
    seeds = shared_seeds(rows, runs)
    kept = [r for r in rows if r["run"] in runs and r["seed"] in seeds]
    return seeds, {s["run"]: s for s in seed_summary(kept)}


def seed_list(seeds: list[int]) -> str:
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(map(str, seeds))


def ratio_claim(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Whether the mean per-step max |dlogp| falls as the compensated ratio grows, over the
    quads@F runs of the compensation mode with the most ratios (plain W4A4 QUADS: no per-token
    scales, the default trainer) and the seeds they share; None with fewer than two ratios."""
    families: dict[str, dict[float, str]] = {}
    for name in dict.fromkeys(r["run"] for r in rows):
        try:
            o = parse_run(name)
        except ValueError:
            continue
        if o["rollout"] != "quads" or "compensation" not in o or o["correction"] != "none":
            continue
        mode = o.get("compensation_mode", "default")
        families.setdefault(mode, {})[o["compensation"]] = name
    if not families:
        return None
    mode, arms = max(families.items(), key=lambda kv: len(kv[1]))
    if len(arms) < 2:
        return None
    ratios = sorted(arms)
    seeds, summary = paired_summary(rows, [arms[r] for r in ratios])
    values = [summary[arms[r]]["dlogp_max_mean"] for r in ratios]
    paper = [f"{PAPER_RATIOS[r]}" if r in PAPER_RATIOS else "?" for r in ratios]
    return {"claim": "max abs dlogp falls as the compensated ratio grows ("
                     + " / ".join(f"{100 * r:g}%" for r in ratios) + f", {mode}, "
                     + seed_list(seeds) + ")",
            "paper": " > ".join(paper),
            "here": " > ".join(f"{v:.3f}" for v in values),
            "holds": all(a > b for a, b in zip(values, values[1:], strict=False))}


def w4a16_claim(rows: list[dict[str, Any]], quads: str) -> dict[str, Any] | None:
    """The paper's ablation: a W4A16 rollout with the weight-QAT trainer alone, and with the
    residual compensation added, ends higher. Here: whether the QUADS arm ends at least as high
    as the `w4a16` run, over the seeds they share; None without a w4a16 run or a shared seed."""
    if "w4a16" not in {r["run"] for r in rows}:
        return None
    try:
        seeds, paired = paired_summary(rows, ["w4a16", quads])
    except ValueError:
        return None
    gain = 100 * (paired[quads]["pass_at_1"] - paired["w4a16"]["pass_at_1"])
    paper = PAPER["w4a16_compensated_pass"] - PAPER["w4a16_pass"]
    return {"claim": f"{quads} ends at or above the W4A16 rollout's pass@1 ({seed_list(seeds)})",
            "paper": f"{paper:.1f} points above ({PAPER['w4a16_pass']} -> "
                     f"{PAPER['w4a16_compensated_pass']})",
            "here": f"{gain:+.1f} points", "holds": gain >= 0}


def per_seed_gaps(rows: list[dict[str, Any]], a: str, b: str, seeds: list[int]) -> list[float]:
    """a's final pass@1 minus b's, in points, seed by seed."""
    final = {(r["run"], r["seed"]): r["final_pass_at_1"] for r in rows}
    return [100 * (final[a, s] - final[b, s]) for s in seeds]


def claims(rows: list[dict[str, Any]], quads: str | None = None) -> list[dict[str, Any]]:
    """The claims as rows {claim, paper, here, holds}, each over the seeds its arms share;
    KeyError naming a missing run, ValueError when the arms share no seed."""
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
    seeds, paired = paired_summary(rows, ["bf16", "nvfp4", quads])
    b, n, q = paired["bf16"], paired["nvfp4"], paired[quads]
    naive_gap = 100 * (b["pass_at_1"] - n["pass_at_1"])
    quads_gap = 100 * (b["pass_at_1"] - q["pass_at_1"])

    def gap_text(gap: float, arm: str) -> str:
        text = f"{gap:.1f} points below"
        if len(seeds) > 1:
            each = per_seed_gaps(rows, "bf16", arm, seeds)
            text += " (per seed " + ", ".join(f"{g:.1f}" for g in each) + ")"
        return text

    order = [b["dlogp_max_mean"], q["dlogp_max_mean"], n["dlogp_max_mean"]]
    k3_ratio = n["k3_mean"] / q["k3_mean"] if q["k3_mean"] > 0 else float("inf")
    over = seed_list(seeds)
    return [
        {"claim": f"naive NVFP4 ends >= 5 points of pass@1 below BF16 ({over})",
         "paper": f"{PAPER['bf16_pass'] - PAPER['naive_pass']:.1f} points below",
         "here": gap_text(naive_gap, "nvfp4"), "holds": naive_gap >= 5},
        {"claim": f"{quads} ends within 1 point of BF16's pass@1 ({over})",
         "paper": f"{PAPER['bf16_pass'] - PAPER['quads_pass']:.2f} points below",
         "here": gap_text(quads_gap, quads), "holds": abs(quads_gap) <= 1},
        {"claim": f"mean per-step max abs dlogp: BF16 < QUADS < naive ({over})",
         "paper": f"{PAPER['floor_dlogp']} < {PAPER['quads_dlogp']} < {PAPER['naive_dlogp']}",
         "here": " < ".join(f"{v:.3f}" for v in order),
         "holds": order[0] < order[1] < order[2]},
        {"claim": f"QUADS's mean k3 at least 3x below naive's ({over})", "paper": "not reported",
         "here": f"{k3_ratio:.2f}x below", "holds": k3_ratio >= 3},
        *([ratios] if (ratios := ratio_claim(rows)) else []),
        *([ablation] if (ablation := w4a16_claim(rows, quads)) else []),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", type=Path, help="an rl-compare rl_compare.json")
    p.add_argument("--quads", help="the QUADS arm (default: the quads@F run with the best pass@1)")
    args = p.parse_args(argv)
    try:
        table = claims(json.loads(args.report.read_text()), args.quads)
    except (KeyError, ValueError, FileNotFoundError) as e:
        print(f"quads_claims: {e}", file=sys.stderr)
        return 2
    print(format_claims(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
