"""Plots every notebook uses, drawn from `MemoryReport`s in one call."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from colab_memopt.core.measure import MemoryReport
from colab_memopt.core.measure import REPORT_CATEGORIES as CATEGORIES

_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_COLORS = {
    "parameters": "#4C72B0",
    "buffers": "#8172B3",
    "gradients": "#DD8452",
    "optimizer_state": "#C44E52",
    "activations": "#55A868",
    "temporaries": "#937860",
    "other": "#8C8C8C",
    "untracked": "#D0D0D0",
}


def memory_bars(
    reports: Mapping[str, MemoryReport],
    *,
    ax: Any = None,
    unit: str = "MiB",
    title: str | None = None,
    limit_bytes: int | None = None,
) -> Any:
    """Draw one stacked bar per report: its peak split by category. Return the axes.

    Args:
        reports: label -> report, in the order to draw.
        unit: 'B', 'KiB', 'MiB' or 'GiB'.
        limit_bytes: draw a horizontal line at a device's capacity.
    """
    import matplotlib.pyplot as plt

    if unit not in _UNITS:
        raise ValueError(f"unit must be one of {list(_UNITS)}, got {unit!r}")
    if not reports:
        raise ValueError("memory_bars needs at least one report")
    scale = _UNITS[unit]
    if ax is None:
        _, ax = plt.subplots(figsize=(1.6 + 1.4 * len(reports), 4))
    labels = list(reports)
    bottoms = [0.0] * len(labels)
    for cat in CATEGORIES:
        values = [reports[k].by_category.get(cat, 0) / scale for k in labels]
        if any(values):
            ax.bar(labels, values, bottom=bottoms, label=cat.replace("_", " "), color=_COLORS[cat])
            bottoms = [b + v for b, v in zip(bottoms, values)]
    for i, k in enumerate(labels):
        ax.text(i, bottoms[i], f"{reports[k].peak_bytes / scale:.1f}", ha="center", va="bottom", fontsize=9)
    if limit_bytes is not None:
        ax.axhline(limit_bytes / scale, color="black", linestyle="--", linewidth=1, label="limit")
    ax.set_ylabel(f"peak memory ({unit})")
    ax.set_title(title or "Peak memory by category")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax


def phase_bars(reports: Mapping[str, MemoryReport], *, ax: Any = None, unit: str = "MiB") -> Any:
    """Draw the peak of the forward, backward and optimizer phases of each report. Return the axes."""
    import matplotlib.pyplot as plt

    scale = _UNITS[unit]
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    phases: Sequence[str] = ("forward", "backward", "optimizer")
    width = 0.8 / len(reports)
    for i, (label, rep) in enumerate(reports.items()):
        xs = [j + i * width for j in range(len(phases))]
        ax.bar(xs, [rep.by_phase.get(p, 0) / scale for p in phases], width=width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(phases))], phases)
    ax.set_ylabel(f"peak in phase ({unit})")
    ax.legend(fontsize=8)
    return ax
