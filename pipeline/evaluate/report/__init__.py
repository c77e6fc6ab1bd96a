"""The evaluation report, one for every recipe: the gate's verdict and reason first, the key figures (the numbers
the run logs to MLflow), then the sections the recipe's evaluator supplies (tables, plots, sample generations),
challenger beside champion, and the baseline where there is one, throughout.

``build_report`` assembles it, ``publish`` writes ``report.html`` (one stylesheet, the plots inlined), the plots
as PNGs beside it and ``metrics.json``, and logs the key figures as the run's metrics. Light at import:
matplotlib is imported when plots are drawn.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from pipeline.evaluate.report.document import History, Report, role_labels
from pipeline.evaluate.report.draw import draw
from pipeline.evaluate.report.figures import PREFIXES, Column, KeyFigures
from pipeline.evaluate.report.page import render

if TYPE_CHECKING:
    from pipeline.evaluate.evaluator import Evaluator


def build_report(evaluator: Evaluator, *, model_name: str, classes: list, scored: Mapping[str, Mapping[str, Any] | None],
                 history: History, decision: Mapping[str, Any], logged: Mapping[str, float] | None = None,
                 facts: tuple[str, ...] = ()) -> Report:
    """The report of one evaluation. ``scored``: ``{role: {"version", "metrics", "details"} or None}``;
    ``history``: each model's run history; ``logged``: the challenger run's MLflow metrics, where a recipe's
    ``baseline`` hook left the untrained model's figures."""
    labels = role_labels(scored)
    columns = [Column(role, label, scored[role]["metrics"]) for role, label in labels.items()]
    baseline = baseline_figures(evaluator.metrics, scored["challenger"], logged or {})
    if baseline:
        columns.append(Column("baseline", f"{evaluator.baseline or 'baseline'} (baseline)", baseline))
    return Report(model_name=model_name, decision=dict(decision), figures=KeyFigures.of(evaluator.metrics, columns),
                  facts=tuple(facts), sections=tuple(evaluator.report_sections(classes, scored, history)))


def baseline_figures(metrics: Mapping[str, bool], challenger: Mapping[str, Any],
                     logged: Mapping[str, float]) -> dict[str, float]:
    """The baseline's figures of the gate's metrics: what the evaluator scored beside the model
    (``details["baseline"]``), else what training logged for the untrained model (``baseline_test_<metric>``)."""
    prefix = PREFIXES["baseline"]
    found = challenger["details"].get("baseline") or {
        name.removeprefix(prefix): value for name, value in logged.items() if name.startswith(prefix)}
    return {name: float(value) for name, value in found.items() if name in metrics}


def write_report(report: Report, out_dir: Path) -> list[Path]:
    """``report.html``, ``metrics.json`` (the key figures by MLflow name) and each plot's PNG, into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pictures = [draw(plot, out_dir / f"{plot.name}.png") for plot in report.plots()]
    page = out_dir / "report.html"
    page.write_text(render(report, {p.stem: p.read_bytes() for p in pictures}))
    summary = out_dir / "metrics.json"
    summary.write_text(json.dumps(report.figures.mlflow_metrics(), indent=2))
    return [page, summary, *pictures]


def publish(report: Report, out_dir: Path, *, log_metrics: Callable[[dict[str, float]], None],
            log_artifact: Callable[[Path], None]) -> list[Path]:
    """Log the key figures as metrics and the written files as artifacts (the evaluate stage passes its run's
    loggers): the run's metrics and the report's table come from the same ``KeyFigures``."""
    log_metrics(report.figures.mlflow_metrics())
    files = write_report(report, out_dir)
    for path in files:
        log_artifact(path)
    return files
