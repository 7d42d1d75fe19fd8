"""Bar charts of a results CSV (format: ``pipeinfer.core.results``).

``plot_results(csv, out_dir)`` writes five PNGs, one bar per mode within each
group, where a group is one (target model, draft model, ranks) combination:

=====================  ===================================================
gen_speed.png          generation speed, tokens/s
ttft.png               time to first token, s
itl.png                mean inter-token latency, s
speed_per_memory.png   tokens/s per GiB of summed peak RSS over all ranks
acceptance.png         draft acceptance rate, % (speculative modes only)
=====================  ===================================================

Rows with the same group and mode (repeats, different prompts) are averaged;
the error bar is their standard deviation. Rows without a draft model
(single, iterative) have no pair of their own: they are drawn in every group
with the same target and ranks, or in a "(no draft)" group if there is none.
A chart without data shows a "no data" note instead of bars.
"""
from __future__ import annotations

import os
import textwrap
from collections import defaultdict
from pathlib import Path

import click
import numpy as np

from ..core.results import read_results

__all__ = ["plot_results", "plot_cmd", "METRICS", "MODE_ORDER"]

MODE_ORDER = ["single", "iterative", "speculative", "pipeinfer"]


def _speed_per_gib(row):
    speed, rss = row.get("gen_tokens_per_s"), row.get("peak_rss_sum_mb")
    if speed is None or not rss:
        return None
    return speed / (rss / 1024.0)


def _percent(row):
    a = row.get("acceptance_rate")
    return None if a is None else 100.0 * a


#: file stem -> (value from a row, y label, title)
METRICS = {
    "gen_speed": (lambda r: r.get("gen_tokens_per_s"), "generation speed (tokens/s)",
                  "Generation speed (excluding prompt processing)"),
    "ttft": (lambda r: r.get("ttft_s"), "time to first token (s)", "Time to first token"),
    "itl": (lambda r: r.get("itl_mean_s"), "mean inter-token latency (s)", "Inter-token latency"),
    "speed_per_memory": (_speed_per_gib, "tokens/s per GiB of summed peak RSS",
                         "Generation speed per memory used (all ranks)"),
    "acceptance": (_percent, "accepted draft tokens (%)", "Draft acceptance rate"),
}


def _short(model) -> str:
    name = os.path.basename(str(model or "").rstrip("/"))
    return name[:-5] if name.lower().endswith(".gguf") else name


def _groups(rows):
    """Map (target, draft, ranks) -> rows, spreading draft-less rows over their target's groups."""
    with_draft = defaultdict(list)
    without = defaultdict(list)
    for r in rows:
        key = (_short(r.get("target_model")), _short(r.get("draft_model")), r.get("ranks") or 0)
        (with_draft if key[1] else without)[key].append(r)
    groups = dict(with_draft)
    for (tgt, _, ranks), rs in without.items():
        targets = [k for k in with_draft if k[0] == tgt and k[2] == ranks]
        for k in targets or [(tgt, "", ranks)]:
            groups.setdefault(k, []).extend(rs)
    return dict(sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])))


def _modes(rows):
    seen = {r.get("mode") or "?" for r in rows}
    return [m for m in MODE_ORDER if m in seen] + sorted(seen - set(MODE_ORDER))


def _pyplot():
    """matplotlib's pyplot on the Agg backend, imported on first use: every command line (every rank of a job)
    loads this module, and pyplot costs 0.3 s of CPU at start-up."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _bar_chart(groups, modes, value, ylabel, title, path, n_prompts):
    def wrap(name):
        return "\n".join(textwrap.wrap(name, 20, break_on_hyphens=False)) or "?"
    labels = [f"{wrap(t)}\n+ {wrap(d) if d else '(no draft)'}\n{n} rank{'s' * (n != 1)}"
              for (t, d, n) in groups]
    width = 0.8 / max(len(modes), 1)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 + 1.8 * len(groups)), 5.4), dpi=100)
    any_bar = False
    x = np.arange(len(groups))
    for i, mode in enumerate(modes):
        means, errs = [], []
        for rs in groups.values():
            vals = [v for v in (value(r) for r in rs if (r.get("mode") or "?") == mode)
                    if v is not None]
            means.append(float(np.mean(vals)) if vals else np.nan)
            errs.append(float(np.std(vals)) if len(vals) > 1 else 0.0)
        if all(np.isnan(means)):
            continue
        any_bar = True
        pos = x - 0.4 + width * (i + 0.5)
        bars = ax.bar(pos, np.nan_to_num(means), width, yerr=errs if any(errs) else None,
                      capsize=3, label=mode, color=f"C{i}")
        for b, m, e in zip(bars, means, errs):
            if not np.isnan(m):
                ax.annotate(f"{m:.3g}", (b.get_x() + b.get_width() / 2, m + e),
                            ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                            textcoords="offset points")
    ax.set_title(title + (f"\nmean over {n_prompts} prompts" if n_prompts > 1 else ""))
    ax.set_ylabel(ylabel)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_xlim(-0.6, max(len(groups), 1) - 0.4)
    ax.set_xlabel("target + draft model, MPI ranks")
    ax.grid(axis="y", alpha=0.3)
    if any_bar:
        ax.legend(title="mode", fontsize=8)
        ax.set_ylim(bottom=0)
    else:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center",
                fontsize=14, color="gray")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_results(csv_path: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """Write the charts listed in the module docstring to ``out_dir``; return their paths."""
    rows = read_results(csv_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = _groups(rows)
    modes = _modes(rows)
    n_prompts = len({r.get("prompt_name") for r in rows})
    paths = []
    for stem, (value, ylabel, title) in METRICS.items():
        path = out / f"{stem}.png"
        _bar_chart(groups, modes, value, ylabel, title, path, n_prompts)
        paths.append(path)
    return paths


@click.command("plot")
@click.argument("csv_path", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--out-dir", type=click.Path(file_okay=False), default="results",
              show_default=True, help="Directory for the PNG files.")
def plot_cmd(csv_path, out_dir):
    """Draw bar charts (PNG) from a results CSV."""
    for p in plot_results(csv_path, out_dir):
        click.echo(str(p))
