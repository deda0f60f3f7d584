"""One PNG per cost curve (:mod:`bench.curves`): a log-log panel per series, a line per
side (ours, DCP; local, GCS; ...), each labelled with its fitted growth exponent k.

matplotlib with the Agg backend (no display); it is the ``report`` extra of the package,
imported only here, when plots are asked for.
"""

from __future__ import annotations

import math
import os
from typing import Any

COLUMNS = 3
DPI = 64
"""Small files (BENCHMARKS.md shows them): ~40-70 KB per curve at this resolution."""
COLORS = {"ours": "tab:blue", "dcp": "tab:orange", "local": "tab:blue", "gcs": "tab:green",
          "s3": "tab:red"}  # fmt: skip
LABELS = {"dcp": "DCP", "gcs": "GCS emulator", "s3": "S3 (SeaweedFS)"}
UNITS = {"s": "seconds", "ratio": "ratio", "bytes": "bytes", "calls": "calls"}


def _positive(x: list[float], y: list[float | None]) -> tuple[list[float], list[float]]:
    """The points a log scale can show."""
    pts = [(a, b) for a, b in zip(x, y, strict=True) if b is not None and a > 0 and b > 0]
    return [a for a, _ in pts], [b for _, b in pts]


def label(side: str, exponent: float) -> str:
    """``"ours (k=1.02)"``; ``"DCP (k=n/a)"`` when the exponent could not be fitted."""
    k = "n/a" if exponent is None or math.isnan(exponent) else f"{exponent:.2f}"
    return f"{LABELS.get(side, side)} (k={k})"


def plot_curve(curve: dict[str, Any], path: str, mode: str) -> None:
    """Write ``curve`` (one entry of :func:`bench.curves.series`) as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(curve["series"].items())
    rows = max(1, math.ceil(len(panels) / COLUMNS))
    cols = min(COLUMNS, max(1, len(panels)))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.1 * rows), squeeze=False)
    for ax, (name, line) in zip(axes.flat, panels, strict=False):
        for side, values in line["lines"].items():
            x, y = _positive(line["x"], values)
            if not x:
                continue
            ax.loglog(x, y, marker="o", color=COLORS.get(side),
                      label=label(side, line["exponents"].get(side)))  # fmt: skip
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(curve["x_label"], fontsize=8)
        ax.set_ylabel(UNITS.get(line.get("unit", ""), line.get("unit", "")), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"{curve['title']} ({mode} mode)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def write_plots(curves: dict[str, Any], out_dir: str, mode: str) -> list[str]:
    """``<curve>.png`` in ``out_dir`` for every curve with series; the file names."""
    written = []
    for name, curve in curves.items():
        if not curve.get("series"):
            continue
        plot_curve(curve, os.path.join(out_dir, f"{name}.png"), mode)
        written.append(f"{name}.png")
    return written
