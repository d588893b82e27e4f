"""The benchmark scripts' curve figures: one layout, the legend below the axes (where it hides
no curve however many there are)."""

from __future__ import annotations


def curves_axes(n_curves: int):
    """(figure, axes) for n_curves labelled curves, the figure tall enough for their legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(8, 4.5 + 0.18 * n_curves))


def save_curves(fig, ax, path: str, *, xlabel: str, ylabel: str, title: str) -> None:
    """Labels, grid and legend, then the PNG at `path`."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"written: {path}")
