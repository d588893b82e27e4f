"""Summaries, tables and plots of an error attribution (`attribution.attribute_error`'s rows)."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence

import torch

from .attribution import LayerError, nan_to_none

# ------------------------------------------------------------------------------- summary


def _mean(values) -> float:
    values = [v for v in values if math.isfinite(v)]
    return statistics.fmean(values) if values else math.nan


def _averages(rows: Sequence[LayerError]) -> dict:
    """Mean errors over rows, and how often the activation error exceeds the weight error."""
    ks = [c.k for c in rows[0].compensated] if rows else []
    ratios = [r.act_weight_ratio for r in rows]
    return {
        "layers": len(rows),
        "weight_only": _mean(r.weight_only for r in rows),
        "act_only": _mean(r.act_only for r in rows),
        "both": _mean(r.both for r in rows),
        "act_dominates": sum(r.act_only > r.weight_only for r in rows),
        "act_dominates_share": (sum(r.act_only > r.weight_only for r in rows) / len(rows)
                                if rows else math.nan),
        "act_weight_ratio_mean": _mean(ratios),
        "act_weight_ratio_median": (statistics.median([v for v in ratios if math.isfinite(v)])
                                    if any(math.isfinite(v) for v in ratios) else math.nan),
        # The two errors are nearly uncorrelated (both² ≈ weight² + act²), so this is the
        # activation's share of the W4A4 error energy.
        "act_energy_share": _mean(r.act_only**2 / (r.act_only**2 + r.weight_only**2)
                                  for r in rows if r.act_only + r.weight_only > 0),
        "compensated": [
            {
                "k": k,
                "vs_exact": _mean(r.compensated[i].vs_exact for r in rows),
                "vs_trainer": _mean(r.compensated[i].vs_trainer for r in rows),
                "gap_removed": _mean(r.compensated[i].gap_removed for r in rows),
            }
            for i, k in enumerate(ks)
        ],
    }


def summarize(rows: Sequence[LayerError]) -> dict:
    """Averages over all analysed layers, the count of skipped ones, and the same per layer type."""
    done = [r for r in rows if r.analysed]
    by_type: dict[str, list[LayerError]] = {}
    for r in done:
        by_type.setdefault(r.layer_type, []).append(r)
    return {
        **_averages(done),
        "skipped": sum(not r.analysed for r in rows),
        "by_type": {t: _averages(rs) for t, rs in by_type.items()},
    }


def report(rows: Sequence[LayerError], **meta) -> dict:
    """A JSON-ready document: `meta`, the torch version, the summary and every row (NaN -> None)."""
    doc = {**meta, "torch": torch.__version__, "summary": summarize(rows),
           "rows": [r.to_dict() for r in rows]}
    return nan_to_none(doc)


# ---------------------------------------------------------------------------- formatting


def _short(name: str) -> str:
    """model.layers.3.self_attn.q_proj -> L3.q_proj; ...mlp.experts.down_proj -> L3.experts.down"""
    block = _block_index(name)
    parts = name.split(".")
    tail = ".".join(parts[-2:]) if "experts" in parts[-2:-1] else parts[-1]
    return name if block is None else f"L{block}.{tail}"


def _pct(v: float) -> str:
    return "n/a" if not math.isfinite(v) else f"{100 * v:.0f}%"


def _num(v: float) -> str:
    return "n/a" if not math.isfinite(v) else f"{v:.4f}"


def _table(header: list[str], lines: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(x[i]) for x in lines)) if lines else len(h)
              for i, h in enumerate(header)]

    def fmt(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest]).rstrip()

    return [fmt(header), fmt(["-" * w for w in widths]), *(fmt(x) for x in lines)]


def _k_label(k: float) -> str:
    return f"{100 * k:g}%"


def format_table(rows: Sequence[LayerError], per_layer: bool = True, title: str = "") -> str:
    """Plain text: per-layer errors (optional), averages per layer type, the summary, skips."""
    done = [r for r in rows if r.analysed]
    ks = [c.k for c in done[0].compensated] if done else []
    summary = summarize(rows)
    comp_head = [f"rc@{_k_label(k)}" for k in ks] + [f"gap-@{_k_label(k)}" for k in ks]
    out = [title, ""] if title else []
    out += [
        "Relative error ||y_hat - y|| / ||y|| against the exact y = x W^T:",
        "  w-only  x Q(W)^T, the trainer's forward     a-only  Q(x) W^T",
        "  both    Q(x) Q(W)^T, naive W4A4             a/w     a-only / w-only",
        "  rc@k    Q(x) Q(W)^T + (x - Q(x))[:, C] Q(W)[:, C]^T, C = the k of channels with the",
        "          largest residual energy in this batch",
        "  gap-@k  share of the W4A4-vs-trainer gap ||Q(x) Q(W)^T - x Q(W)^T|| that rc@k removes",
        "Fused experts: one row per projection, tokens summed over experts (each measured alone).",
        "",
    ]
    if per_layer:
        lines = [
            [_short(r.name), f"{r.in_features}x{r.out_features}", str(r.tokens),
             _num(r.weight_only), _num(r.act_only), _num(r.both), f"{r.act_weight_ratio:.2f}",
             *(_num(c.vs_exact) for c in r.compensated),
             *(_pct(c.gap_removed) for c in r.compensated)]
            for r in done
        ]
        head = ["layer", "KxN", "tokens", "w-only", "a-only", "both", "a/w", *comp_head]
        out += _table(head, lines) + [""]

    def avg_line(label: str, s: dict) -> list[str]:
        return [label, str(s["layers"]), f"{s['act_dominates']}/{s['layers']}",
                _num(s["weight_only"]), _num(s["act_only"]), _num(s["both"]),
                f"{s['act_weight_ratio_mean']:.2f}",
                *(_num(c["vs_exact"]) for c in s["compensated"]),
                *(_pct(c["gap_removed"]) for c in s["compensated"])]

    head = ["mean by layer type", "n", "a>w", "w-only", "a-only", "both", "a/w", *comp_head]
    lines = [avg_line(t, s) for t, s in summary["by_type"].items()] + [avg_line("all", summary)]
    out += _table(head, lines)
    out += ["", *summary_lines(summary)]
    skipped = [r for r in rows if not r.analysed]
    if skipped:
        out += ["", f"Skipped ({len(skipped)}):"]
        out += [f"    {r.name}: {r.skipped}" for r in skipped]
    return "\n".join(out)


def summary_lines(summary: dict) -> list[str]:
    """The headline numbers in words."""
    n = summary["layers"]
    if n == 0:
        return ["No layer was analysed."]
    comp = ", ".join(f"{_k_label(c['k'])}: {_pct(c['gap_removed'])}"
                     for c in summary["compensated"])
    return [
        f"Activation error > weight error in {summary['act_dominates']} of {n} layers "
        f"({_pct(summary['act_dominates_share'])}).",
        f"act-only / weight-only: mean {summary['act_weight_ratio_mean']:.2f}, median "
        f"{summary['act_weight_ratio_median']:.2f}; activation share of the error energy "
        f"a²/(a² + w²): {_pct(summary['act_energy_share'])}.",
        f"Mean error: weight-only {summary['weight_only']:.4f}, act-only "
        f"{summary['act_only']:.4f}, both {summary['both']:.4f}.",
        f"Mean share of the W4A4-vs-trainer gap removed by compensation with k = {comp}.",
    ]


# ---------------------------------------------------------------------------------- plot


def _block_index(name: str) -> int | None:
    m = re.search(r"(?:^|\.)(?:layers|blocks|h)\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def plot(rows: Sequence[LayerError], path: str, title: str = "") -> None:
    """A PNG with one column per layer type (q_proj, ..., experts.down_proj) and the block index
    on the x axis: the error of each variant against y (top row) and the share of the
    W4A4-vs-trainer gap that compensation removes (bottom row). Needs matplotlib."""
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError("plot needs matplotlib: pip install 'fp4stack[analysis]'") from e
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    done = [r for r in rows if r.analysed]
    if not done:
        raise ValueError("no analysed layer to plot")
    by_type: dict[str, list[LayerError]] = {}
    for r in done:
        by_type.setdefault(r.layer_type, []).append(r)
    ks = [c.k for c in done[0].compensated]
    greens = plt.get_cmap("Greens")
    shades = [greens(0.4 + 0.55 * i / max(1, len(ks) - 1)) for i in range(len(ks))]
    errors = [v for r in done for v in (r.weight_only, r.act_only, r.both) if v > 0]
    log = bool(errors) and max(errors) / min(errors) > 5  # log only when it spans a decade

    cols = len(by_type)
    fig, axes = plt.subplots(2, cols, figsize=(2.6 * cols + 1.5, 6.5), sharey="row",
                             squeeze=False, gridspec_kw={"height_ratios": [3, 2]})
    for j, (layer_type, group) in enumerate(by_type.items()):
        blocks = [_block_index(r.name) for r in group]
        xs = blocks if None not in blocks else list(range(len(group)))
        top, bottom = axes[0][j], axes[1][j]
        top.plot(xs, [r.weight_only for r in group], "o-", ms=3, lw=1.2, color="tab:blue",
                 label="weight-only  x Q(W)ᵀ (trainer)")
        top.plot(xs, [r.act_only for r in group], "s-", ms=3, lw=1.2, color="tab:orange",
                 label="activation-only  Q(x) Wᵀ")
        top.plot(xs, [r.both for r in group], "^-", ms=3, lw=1.2, color="tab:red",
                 label="both  Q(x) Q(W)ᵀ (naive W4A4)")
        for i, k in enumerate(ks):
            top.plot(xs, [r.compensated[i].vs_exact for r in group], "--", lw=1,
                     color=shades[i], label=f"compensated, k = {_k_label(k)} of channels")
            bottom.plot(xs, [100 * r.compensated[i].gap_removed for r in group], ".-", lw=1,
                        color=shades[i])
        top.set_title(layer_type, fontsize=10)
        if log:
            top.set_yscale("log")
        bottom.set_ylim(0, 100)
        bottom.set_xlabel("block" if None not in blocks else "layer")
        for ax in (top, bottom):
            ax.grid(True, which="both", alpha=0.3)
            ax.tick_params(labelsize=8)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0][0].set_ylabel("relative error vs exact x Wᵀ")
    axes[1][0].set_ylabel("% of W4A4-vs-trainer\ngap removed")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(title or "Per-layer W4A4 error attribution", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
