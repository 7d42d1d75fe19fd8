"""The benchmarks' grouped bar chart: one group of bars per x position, one bar (and legend entry) per series.

    from charts import grouped_bars
    grouped_bars(path, groups, series, value, ylabel=..., title=...)   # value(group, series) -> float
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence


def grouped_bars(path: Path, groups: Sequence[str], series: Sequence[str], value: Callable[[str, str], float], *,
                 ylabel: str, title: str, group_labels: Sequence[str] | None = None, figsize=(8, 4),
                 bar_labels: bool = False, baseline: float | None = None, xtick_kw: dict | None = None,
                 ylim_top: float | None = None, title_size: float | None = None, dpi: int = 110) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=figsize)
    width = 0.8 / len(series)
    for k, name in enumerate(series):
        bars = ax.bar([i + k * width for i in range(len(groups))], [value(g, name) for g in groups], width,
                      label=name)
        if bar_labels:
            ax.bar_label(bars, fmt="%.1f", fontsize=8)
    if baseline is not None:
        ax.axhline(baseline, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(groups))], group_labels or groups,
                  **(xtick_kw or {}))
    ax.set_ylabel(ylabel)
    if ylim_top is not None:
        ax.set_ylim(0, ylim_top)
    ax.set_title(title, fontsize=title_size)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
