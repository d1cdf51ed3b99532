"""Printing and saving benchmark figures."""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def print_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [list(map(str, header))] + [list(map(str, r)) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for j, row in enumerate(cells):
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def output_path(text: str) -> str:
    """An argparse type for a file a command writes at its end (``--json``, ``--plot``, ``--out``): refused at once
    where no file can be made (else a run of minutes ended in a traceback). Its nearest directory that exists is
    tried with a file of its own, removed at once."""
    path = Path(text).expanduser()
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is no file to write")
    existing = path.parent
    while not existing.exists():
        existing = existing.parent
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {text} ({e.strerror})") from None
    return text


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")


def plot_sweep(
    path: str | Path,
    rows: Sequence[dict],
    title: str,
    metrics: Sequence[tuple[str, str]] = (("avg_latency_s", "average program latency (s)"),),
    x: tuple[str, str] = ("rate", "program arrival rate (programs/s)"),
    series: str | Callable[[dict], str] = "policy",
) -> bool:
    """A PNG of a sweep: ``metrics`` (key, axis label) of ``rows`` against ``x``, a panel per metric and a line per
    value of ``series`` (a row's key, or a function of the row); False (and nothing written) where matplotlib is
    not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: a file only
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    line_of = series if callable(series) else (lambda row: str(row[series]))
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4), squeeze=False)
    for ax, (key, label) in zip(axes[0], metrics, strict=True):
        for name in dict.fromkeys(line_of(r) for r in rows):
            points = sorted((r[x[0]], r[key]) for r in rows if line_of(r) == name)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.set_xlabel(x[1])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
