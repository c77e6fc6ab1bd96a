"""The evaluation report: PNG plots and one HTML page, champion and challenger side by side."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.evaluate.metrics import binary_curves, confusion_matrix, per_class


def score_details(labels: np.ndarray, probabilities: np.ndarray) -> dict[str, Any]:
    """Everything the report shows about one model on the test split."""
    details: dict[str, Any] = {
        "per_class": per_class(labels, probabilities),
        "confusion": confusion_matrix(labels, probabilities.argmax(axis=1), probabilities.shape[1]).tolist(),
    }
    if probabilities.shape[1] == 2:
        details["curves"] = binary_curves(labels, probabilities[:, 1])
    return details


def write_report(
    out_dir: Path, *, model_name: str, classes: list, scored: dict[str, dict[str, Any] | None],
    history: dict[str, list[tuple[int, float]]], decision: dict[str, Any],
) -> list[Path]:
    """Write the plots and ``report.html`` into ``out_dir``; return the files written.

    ``scored`` maps ``challenger``/``champion`` to ``{"version", "metrics", "details"}`` (or None).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    present = {role: s for role, s in scored.items() if s is not None}
    files: list[Path] = []

    fig, axes = plt.subplots(1, len(present), figsize=(4.5 * len(present), 4), squeeze=False)
    for ax, (role, s) in zip(axes[0], present.items()):
        matrix = np.asarray(s["details"]["confusion"])
        ax.imshow(matrix, cmap="Blues")
        for (i, j), count in np.ndenumerate(matrix):
            ax.text(j, i, str(count), ha="center", va="center", color="black", fontsize=8)
        ax.set_xticks(range(len(classes)), [str(c) for c in classes])
        ax.set_yticks(range(len(classes)), [str(c) for c in classes])
        ax.set_xlabel("predicted")
        ax.set_ylabel("true")
        ax.set_title(f"{role} v{s['version']}")
    files.append(_save(fig, out_dir / "confusion_matrix.png"))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(present)
    for n, (role, s) in enumerate(present.items()):
        f1 = [row["f1"] for row in s["details"]["per_class"]]
        ax.bar(np.arange(len(classes)) + n * width, f1, width, label=f"{role} v{s['version']}")
    ax.set_xticks(np.arange(len(classes)) + width * (len(present) - 1) / 2, [str(c) for c in classes])
    ax.set_ylabel("F1")
    ax.set_ylim(0, 1)
    ax.legend()
    files.append(_save(fig, out_dir / "per_class_f1.png"))

    if all("curves" in s["details"] for s in present.values()):
        fig, (roc, pr) = plt.subplots(1, 2, figsize=(9, 4))
        for role, s in present.items():
            c = s["details"]["curves"]
            roc.plot(c["fpr"], c["tpr"], label=f"{role} AUC {c['roc_auc']:.3f}")
            pr.plot(c["recall"], c["precision"], label=f"{role} AP {c['average_precision']:.3f}")
        roc.set(xlabel="false positive rate", ylabel="true positive rate", title="ROC")
        pr.set(xlabel="recall", ylabel="precision", title="precision-recall")
        roc.legend()
        pr.legend()
        files.append(_save(fig, out_dir / "roc_pr.png"))

    curves = {k: v for k, v in history.items() if v}
    if curves:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, points in sorted(curves.items()):
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o" if len(points) < 20 else None, label=key)
        ax.set_xlabel("step")
        ax.set_title("training curves (challenger run)")
        ax.legend()
        files.append(_save(fig, out_dir / "training_curves.png"))

    page = out_dir / "report.html"
    page.write_text(_html(model_name, classes, present, decision, [f for f in files if f.suffix == ".png"]))
    files.append(page)
    return files


def text_summary(classes: list, scored: dict[str, dict[str, Any] | None], decision: dict[str, Any]) -> str:
    """A compact text version of the report for the task log."""
    present = {role: s for role, s in scored.items() if s is not None}
    lines = ["metric        " + "".join(f"{role + ' v' + str(s['version']):>20}" for role, s in present.items())]
    for key in ("accuracy", "macro_f1", "log_loss"):
        lines.append(f"{key:<14}" + "".join(f"{s['metrics'][key]:>20.4f}" for s in present.values()))
    for k, label in enumerate(classes):
        lines.append(f"F1[{label}]".ljust(14) + "".join(f"{s['details']['per_class'][k]['f1']:>20.4f}" for s in present.values()))
    lines.append(f"gate: {decision['status']}: {decision['reason']}")
    return "\n".join(lines)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _html(model_name: str, classes: list, present: dict, decision: dict, images: list[Path]) -> str:
    esc = html.escape
    header = "".join(f"<th>{esc(role)} v{esc(str(s['version']))}</th>" for role, s in present.items())
    rows = "".join(
        f"<tr><td>{key}</td>" + "".join(f"<td>{s['metrics'][key]:.4f}</td>" for s in present.values()) + "</tr>"
        for key in ("accuracy", "macro_f1", "log_loss", "majority_rate")
    )
    class_rows = "".join(
        f"<tr><td>{esc(str(label))}</td>" + "".join(
            "<td>P {precision:.3f} R {recall:.3f} F1 {f1:.3f} n={support}</td>".format(**s["details"]["per_class"][k])
            for s in present.values()
        ) + "</tr>"
        for k, label in enumerate(classes)
    )
    pictures = "".join(
        f'<h3>{esc(p.stem.replace("_", " "))}</h3><img alt="{esc(p.stem)}" '
        f'src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
        for p in images
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{esc(model_name)} evaluation</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{border:1px solid #ccc;padding:4px 8px}}table{{border-collapse:collapse}}</style>
</head><body>
<h1>{esc(model_name)}: challenger vs champion</h1>
<p><b>Gate {esc(decision['status'])}</b>: {esc(decision['reason'])}</p>
<h2>Test metrics</h2><table><tr><th>metric</th>{header}</tr>{rows}</table>
<h2>Per class</h2><table><tr><th>class</th>{header}</tr>{class_rows}</table>
{pictures}
</body></html>
"""
