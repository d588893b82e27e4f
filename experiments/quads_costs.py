"""What each rollout precision of a comparison costs in the fast engine beside what it buys.

Joins an `rl-compare` report (rl_compare.json: final pass@1, mean k3 and mean per-step max
|dlogp| of each run, averaged over its seeds) with `benchmarks/bench_rollout.py` results
(tokens/s of each precision at the policy's shape) into one markdown table, the basis for
choosing QUADS's default compensated ratio, static or dynamic channels, and the activation
scaling. A run and an engine row match on the rollout precision, for QUADS on the compensated
fraction and the channel mode, and on Four Over Six scales; tokens/s are given against the BF16
row of the same results file.

    python experiments/quads_costs.py runs/rl-compare/all/rl_compare.json \\
        benchmarks/results/bench_rollout_smollm2_moe_h100_2026-12-05.json [more.json ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fp4stack.rl.compare_report import seed_summary


def engine_speeds(results: list[dict[str, Any]]) -> dict[tuple, tuple[float, float]]:
    """{(precision, compensation, mode, four_over_six): (tokens/s, against BF16 in the same
    file)} from bench_rollout results (fast-engine rows; the last file wins a key two files
    share)."""
    out = {}
    for res in results:
        rows = [r for r in res["rows"] if r.get("engine") == "fast"]
        bf16 = next((r["tokens_per_s"] for r in rows if r["precision"] == "bf16"), None)
        for r in rows:
            precision, _, mode = r["precision"].partition(":")
            compensation = r.get("compensation")
            key = (precision, compensation, (mode or "dynamic") if compensation else None,
                   bool(r.get("four_over_six", False)))
            out[key] = (r["tokens_per_s"], r["tokens_per_s"] / bf16 if bf16 else float("nan"))
    return out


def run_key(row: dict[str, Any]) -> tuple:
    """A report row's engine key: its rollout, for QUADS its fraction and channel mode, and
    whether its NVFP4 block scales were Four Over Six."""
    four_six = bool(row.get("four_over_six", False))
    if row["rollout"].startswith("quads"):
        return (row["rollout"], row["compensation"], row.get("compensation_mode", "dynamic"),
                four_six)
    return row["rollout"], None, None, four_six


def cost_table(report: list[dict[str, Any]], speeds: dict[tuple, tuple[float, float]]
               ) -> list[dict[str, Any]]:
    """A row per run (means over its seeds) with the engine's speed where it was measured."""
    keys = {r["run"]: run_key(r) for r in report}
    out = []
    for s in seed_summary(report):
        tokens, vs_bf16 = speeds.get(keys[s["run"]], (None, None))
        out.append({**s, "tokens_per_s": tokens, "vs_bf16": vs_bf16})
    return out


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| run | seeds | engine tokens/s | vs BF16 | final pass@1 | mean k3 | "
             "mean max abs dlogp |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        speed = ("not measured", "") if r["tokens_per_s"] is None else (
            f"{r['tokens_per_s']:,.0f}", f"{r['vs_bf16']:.2f}x")
        pass1 = "-" if r["pass_at_1"] is None else f"{r['pass_at_1']:.3f}"
        dlogp = "-" if r["dlogp_max_mean"] is None else f"{r['dlogp_max_mean']:.3f}"
        lines.append(f"| {r['run']} | {r['seeds']} | {speed[0]} | {speed[1]} | {pass1} | "
                     f"{r['k3_mean']:.2e} | {dlogp} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", help="an rl-compare report's rl_compare.json")
    p.add_argument("engine", nargs="+", help="bench_rollout.py results (JSON)")
    args = p.parse_args(argv)
    report = json.loads(Path(args.report).read_text())
    speeds = engine_speeds([json.loads(Path(f).read_text()) for f in args.engine])
    print(format_table(cost_table(report, speeds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
