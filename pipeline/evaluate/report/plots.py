"""Plots as data: the panels, series, axes and limits of each plot, built by the evaluators, drawn by
``pipeline.evaluate.report.draw`` and read by the tests (what a plot was given, not its pixels)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

LABEL_CHARS = 18  # longer class names are cut (the tables keep them whole)
MARKERS_UP_TO = 30  # points per series: fewer get a marker each, so a short run's curve still shows its points


def short_label(name: object, width: int = LABEL_CHARS) -> str:
    """``name`` on one line, cut to ``width`` characters with an ellipsis."""
    text = " ".join(str(name).split())
    return text if len(text) <= width else text[:width - 1] + "…"


@dataclass(frozen=True)
class Series:
    label: str  # the legend's
    role: str  # challenger, champion or baseline: its colour, the same in every plot
    x: tuple
    y: tuple[float, ...]
    style: str = "solid"  # solid, dashed or dotted: tells one model's series apart (train, val)
    marker: bool = True


@dataclass(frozen=True)
class Heatmap:
    counts: tuple[tuple[int, ...], ...]  # rows: true classes, columns: predicted
    shares: tuple[tuple[float, ...], ...]  # each row over its total: the colour (a recall-normalized view)
    labels: tuple[str, ...]  # rows' and columns' tick labels; () when there are too many classes to label
    rotation: int  # of the columns' labels, in degrees
    annotate: bool  # counts written in the cells


@dataclass(frozen=True)
class Panel:
    title: str
    kind: str = "line"  # line; hbar: grouped horizontal bars, one row per category; heatmap
    series: tuple[Series, ...] = ()
    categories: tuple[str, ...] = ()  # hbar: the rows' labels, top to bottom
    heatmap: Heatmap | None = None
    xlabel: str = ""
    ylabel: str = ""
    xlim: tuple[float, float] | None = None
    ylim: tuple[float, float] | None = None
    xscale: str = "linear"
    xticks: tuple[float, ...] = ()  # () leaves them to matplotlib
    integer_x: bool = False  # steps: whole ticks only

    def roles(self) -> set[str]:
        return {s.role for s in self.series}


@dataclass(frozen=True)
class Plot:
    name: str  # the PNG's file stem
    title: str
    panels: tuple[Panel, ...]
    columns: int = 2  # panels side by side; more go on further rows
    panel_inches: tuple[float, float] = (5.0, 3.6)

    def panel(self, title: str) -> Panel:
        found = [p for p in self.panels if p.title == title]
        if not found:
            raise KeyError(f"plot {self.name} has no panel {title!r}: {[p.title for p in self.panels]}")
        return found[0]


def is_loss(key: str) -> bool:
    return key.endswith("loss")


def curve_style(key: str) -> str:
    return "dashed" if key.startswith("val_") else "dotted" if key.startswith("step_") else "solid"


def value_limits(values: Sequence[float], *, from_zero: bool) -> tuple[float, float]:
    """Limits that show every value with a margin: shares (all within 0..1) on 0..1, losses from 0."""
    low, high = min(values), max(values)
    if not from_zero and low >= 0 and high <= 1:
        return 0.0, 1.02
    if from_zero and low >= 0:
        return 0.0, high * 1.08 if high > 0 else 1.0
    pad = (high - low) * 0.08 or abs(high) * 0.1 or 1.0
    return low - pad, high + pad


def step_limits(steps: Sequence[float]) -> tuple[float, float]:
    """From step 0 (or the first) to just past the last, so that a run of one or two points is not a lone dot
    on an axis of its own few steps."""
    last = max(steps)
    return min(0.0, min(steps)), last + max(1.0, 0.03 * last)


def training_curves(history: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]],
                    labels: Mapping[str, str]) -> Plot | None:
    """Each model's run history (``{role: {metric: [(step, value)]}}``): losses on one panel, the other metrics
    on another, every model in its colour, train solid, validation dashed; None when nothing was logged."""
    curves = [(role, key, sorted(points)) for role in labels for key, points in sorted(history.get(role, {}).items())
              if points]
    panels = []
    for title, losses in (("loss", True), ("metrics", False)):
        chosen = [(role, key, points) for role, key, points in curves if is_loss(key) == losses]
        if not chosen:
            continue
        series = tuple(Series(f"{labels[role]} {key}", role, tuple(s for s, _ in points), tuple(v for _, v in points),
                              style=curve_style(key), marker=len(points) <= MARKERS_UP_TO)
                       for role, key, points in chosen)
        panels.append(Panel(
            title, series=series, xlabel="step", ylabel=title, integer_x=True,
            xlim=step_limits([x for s in series for x in s.x]),
            ylim=value_limits([y for s in series for y in s.y], from_zero=losses)))
    return Plot("training_curves", "Training curves of each model's run", tuple(panels)) if panels else None
