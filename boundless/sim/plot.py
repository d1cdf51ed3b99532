"""A PNG of a simulated sweep: one line per policy, a metric against the arrival rate."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def plot_sweep(
    path: str | Path,
    rows: Sequence[dict],
    title: str,
    metrics: Sequence[tuple[str, str]] = (("avg_latency_s", "average program latency (s)"),),
    x: tuple[str, str] = ("rate", "program arrival rate (programs/s)"),
    series: str = "policy",
) -> bool:
    """Draw ``metrics`` (key, axis label) of ``rows`` against ``x``, a panel per metric and a line per value of
    ``series``; False (and nothing written) where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: a file only
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4), squeeze=False)
    for ax, (key, label) in zip(axes[0], metrics, strict=True):
        for name in dict.fromkeys(r[series] for r in rows):
            points = sorted((r[x[0]], r[key]) for r in rows if r[series] == name)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=str(name))
        ax.set_xlabel(x[1])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
