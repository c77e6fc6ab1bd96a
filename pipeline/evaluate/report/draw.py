"""Draws a ``Plot`` into a PNG with matplotlib (Agg): every model in the same colour in every plot."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pipeline.evaluate.report.plots import Panel, Plot

COLOURS = {"challenger": "#1f63b4", "champion": "#e8710a", "baseline": "#7a7a7a"}
LINESTYLES = {"solid": "-", "dashed": "--", "dotted": ":"}
DPI = 100


def draw(plot: Plot, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(plot.columns, len(plot.panels))
    rows = math.ceil(len(plot.panels) / columns)
    width, height = plot.panel_inches
    # "constrained" keeps the title, panel titles and colour bars apart; "tight" keeps legends placed below a panel.
    fig, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows), squeeze=False, layout="constrained")
    for ax, panel in zip(axes.flat, plot.panels):
        {"line": _lines, "hbar": _hbars, "heatmap": _heatmap}[panel.kind](ax, panel)
        _decorate(ax, panel)
    for ax in list(axes.flat)[len(plot.panels):]:
        ax.set_visible(False)
    fig.suptitle(plot.title, fontsize=12)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def _lines(ax, panel: Panel) -> None:
    for s in panel.series:
        ax.plot(s.x, s.y, color=COLOURS[s.role], linestyle=LINESTYLES[s.style], marker="o" if s.marker else None,
                markersize=4, linewidth=1.6 if s.role != "baseline" else 1.2, label=s.label)
    _legend(ax, len(panel.series))


def _hbars(ax, panel: Panel) -> None:
    positions = np.arange(len(panel.categories))
    height = 0.8 / max(len(panel.series), 1)
    for n, s in enumerate(panel.series):
        ax.barh(positions - 0.4 + height * (n + 0.5), s.y, height, color=COLOURS[s.role], label=s.label)
    ax.set_yticks(positions, panel.categories, fontsize=8)
    ax.set_ylim(len(panel.categories) - 0.5, -0.5)  # the first category on top
    _legend(ax, len(panel.series))


def _heatmap(ax, panel: Panel) -> None:
    heatmap = panel.heatmap
    shares = np.asarray(heatmap.shares, dtype=float)
    image = ax.imshow(shares, cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
    if heatmap.annotate:
        for (i, j), count in np.ndenumerate(np.asarray(heatmap.counts)):
            if count:
                ax.text(j, i, str(count), ha="center", va="center", fontsize=8,
                        color="white" if shares[i, j] > 0.55 else "black")
    n = len(shares)
    if heatmap.labels:
        slanted = 0 < heatmap.rotation < 90
        ax.set_xticks(range(n), heatmap.labels, rotation=heatmap.rotation, fontsize=8,
                      ha="right" if slanted else "center", rotation_mode="anchor" if slanted else "default")
        ax.set_yticks(range(n), heatmap.labels, fontsize=8)
    else:  # class indices every tenth: the top-confusions table names the classes
        ax.set_xticks(range(0, n, 10))
        ax.set_yticks(range(0, n, 10))
    ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.03, label="share of the true class")


def _legend(ax, count: int) -> None:
    if count > 3:  # below the panel, where it hides no curve
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    elif count:
        ax.legend(fontsize=8, loc="best")


def _decorate(ax, panel: Panel) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel(panel.xlabel)
    ax.set_ylabel(panel.ylabel)
    if panel.xscale != "linear":
        ax.set_xscale(panel.xscale)
    if panel.xticks:
        ax.set_xticks(panel.xticks, [f"{t:g}" for t in panel.xticks])
        ax.minorticks_off()
    elif panel.integer_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if panel.xlim:
        ax.set_xlim(*panel.xlim)
    if panel.ylim:
        ax.set_ylim(*panel.ylim)
    if panel.kind != "heatmap":
        ax.grid(True, alpha=0.3)
