"""The classification report's plots and tables, challenger beside champion in each: confusion matrices that
read up to 100 classes (a normalized view, shortened and rotated labels, the most frequent confusions listed),
per-class F1 sorted, and ROC and precision-recall curves of a binary task against chance."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from pipeline.evaluate.report.document import Table
from pipeline.evaluate.report.plots import MARKERS_UP_TO, Heatmap, Panel, Plot, Series, short_label

ANNOTATED_UP_TO = 12  # classes: the counts are written in the cells, and both matrices sit side by side
LABELLED_UP_TO = 40  # classes: every row and column is labelled; beyond, indices (the confusions table names them)
F1_BARS_UP_TO = 40  # classes in the per-class F1 plot: the lowest ones when there are more
TOP_CONFUSIONS = 15


def shares(matrix: np.ndarray) -> np.ndarray:
    """Each row (a true class) over its total: the share of that class predicted as each class."""
    totals = matrix.sum(axis=1, keepdims=True)
    return np.divide(matrix, totals, out=np.zeros(matrix.shape, dtype=float), where=totals > 0)


def label_rotation(labels: Sequence[str]) -> int:
    """Short labels stay level; longer ones slant, and many long ones stand upright so none runs into the next."""
    if max((len(label) for label in labels), default=0) <= 3:
        return 0
    return 45 if len(labels) <= ANNOTATED_UP_TO else 90


def confusion_plot(names: Sequence[str], matrices: Mapping[str, np.ndarray], labels: Mapping[str, str]) -> Plot:
    """One matrix per model, coloured by the share of each true class (rows) predicted as each class."""
    n = len(names)
    ticks = tuple(short_label(name) for name in names) if n <= LABELLED_UP_TO else ()
    side = min(max(4.5, 1.6 + 0.3 * n), 11.0) if ticks else 8.0
    panels = tuple(Panel(labels[role], kind="heatmap", xlabel="predicted", ylabel="true", heatmap=Heatmap(
        counts=tuple(map(tuple, matrix.tolist())), shares=tuple(map(tuple, shares(matrix).tolist())), labels=ticks,
        rotation=label_rotation(ticks), annotate=n <= ANNOTATED_UP_TO)) for role, matrix in matrices.items())
    what = "counts in the cells, " if n <= ANNOTATED_UP_TO else ""
    return Plot("confusion_matrix", f"Confusion matrices ({what}colour: share of the true class)", panels,
                columns=2 if n <= ANNOTATED_UP_TO else 1, panel_inches=(side + 1.4, side))


def top_confusions(names: Sequence[str], matrices: Mapping[str, np.ndarray], labels: Mapping[str, str],
                   limit: int = TOP_CONFUSIONS) -> Table:
    """The most frequent (true, predicted) mistakes of either model, each with every model's count and share."""
    off = {role: matrix * (1 - np.eye(len(matrix), dtype=matrix.dtype)) for role, matrix in matrices.items()}
    worst = np.max(np.stack(list(off.values())), axis=0)
    order = [(int(i), int(j)) for i, j in zip(*np.unravel_index(np.argsort(-worst, axis=None, kind="stable"), worst.shape))
             if worst[i, j] > 0][:limit]
    columns = ["true class", "predicted as", *("rows", "share of the true class") * len(labels)]
    share = {role: shares(matrix) for role, matrix in matrices.items()}
    # An unlabelled matrix is read by index: the table gives both.
    name = (lambda k: f"{k}: {names[k]}") if len(names) > LABELLED_UP_TO else (lambda k: str(names[k]))
    rows = []
    for i, j in order:
        row = [name(i), name(j)]
        for role in labels:
            row += [int(matrices[role][i, j]), float(share[role][i, j])]
        rows.append(tuple(row))
    return Table(tuple(columns), tuple(rows), caption=f"Most frequent confusions (up to {limit})",
                 groups=(("", 2, ""), *((label, 2, role) for role, label in labels.items())))


def per_class_f1_plot(names: Sequence[str], per_class: Mapping[str, list[dict]], labels: Mapping[str, str]) -> Plot:
    """F1 by class, sorted by the challenger's, lowest first: the classes that need work lead."""
    order = f1_order(per_class["challenger"], names)
    shown = order[:F1_BARS_UP_TO]
    series = tuple(Series(labels[role], role, tuple(str(names[k]) for k in shown),
                          tuple(rows[k]["f1"] for k in shown)) for role, rows in per_class.items())
    title = "Per-class F1, lowest first" + (f" (the {len(shown)} lowest of {len(order)} classes)"
                                             if len(shown) < len(order) else "")
    panel = Panel("F1 by class", kind="hbar", series=series, categories=tuple(short_label(names[k], 28) for k in shown),
                  xlabel="F1", xlim=(0.0, 1.0))
    height = 1.2 + 0.16 * len(shown) * max(len(series), 1)
    return Plot("per_class_f1", title, (panel,), columns=1, panel_inches=(8.0, max(2.8, height)))


def f1_order(rows: list[dict], names: Sequence[str]) -> list[int]:
    return sorted(range(len(rows)), key=lambda k: (rows[k]["f1"], str(names[k])))


def per_class_table(names: Sequence[str], per_class: Mapping[str, list[dict]], labels: Mapping[str, str]) -> Table:
    columns = ["class", "test rows", *("precision", "recall", "F1") * len(labels)]
    rows = []
    for k in f1_order(per_class["challenger"], names):
        row = [str(names[k]), int(per_class["challenger"][k]["support"])]
        for role in labels:
            row += [per_class[role][k][key] for key in ("precision", "recall", "f1")]
        rows.append(tuple(row))
    return Table(tuple(columns), tuple(rows), caption="Per class, by the challenger's F1, lowest first",
                 groups=(("", 2, ""), *((label, 3, role) for role, label in labels.items())))


def roc_pr_plot(curves: Mapping[str, dict], labels: Mapping[str, str], positive: str, positive_share: float) -> Plot:
    """ROC and precision-recall of each model, with chance: the diagonal, and the positive class's share."""
    def line(role, label, x, y):
        x, y = tuple(map(float, x)), tuple(map(float, y))
        return Series(label, role, x, y, marker=len(x) <= MARKERS_UP_TO)

    roc = [line(role, f"{labels[role]} (AUC {c['roc_auc']:.3f})", c["fpr"], c["tpr"]) for role, c in curves.items()]
    pr = [line(role, f"{labels[role]} (AP {c['average_precision']:.3f})", c["recall"], c["precision"])
          for role, c in curves.items()]
    roc.append(Series("chance", "baseline", (0.0, 1.0), (0.0, 1.0), style="dashed", marker=False))
    pr.append(Series(f"chance (positive share {positive_share:.3f})", "baseline", (0.0, 1.0),
                     (positive_share, positive_share), style="dashed", marker=False))
    limits = {"xlim": (0.0, 1.0), "ylim": (0.0, 1.02)}
    return Plot("roc_pr", f"ROC and precision-recall (positive class: {short_label(positive)})", (
        Panel("ROC", series=tuple(roc), xlabel="false positive rate", ylabel="true positive rate", **limits),
        Panel("precision-recall", series=tuple(pr), xlabel="recall", ylabel="precision", **limits)))
