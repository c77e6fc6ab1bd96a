"""One source for the key figures: what ``publish`` logs to a real MLflow run is exactly what the report's table,
its ``metrics.json`` and the task log's summary show, for every recipe's synthetic evaluation."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from pipeline.evaluate.report import publish
from tests import reports


class FigureCells(HTMLParser):
    """The key-figures table's cells that name an MLflow metric: {name: (exact value, text shown)}."""

    def __init__(self):
        super().__init__()
        self.cells: dict[str, tuple[float, str]] = {}
        self._open: tuple[str, float] | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "td" and "data-mlflow" in attrs:
            self._open = (attrs["data-mlflow"], float(attrs["data-value"]))

    def handle_data(self, data):
        if self._open:
            name, value = self._open
            self.cells[name] = (value, data)
            self._open = None


@pytest.fixture(scope="module")
def mlflow_client():
    from pipeline.registry import tracking

    return tracking.client()


@pytest.mark.parametrize("case", sorted(reports.CASES))
def test_the_run_metrics_and_the_report_show_the_same_figures(case, mlflow_client, tmp_path):
    from pipeline.registry import tracking

    report = reports.report(case)
    run_id = mlflow_client.create_run(tracking.experiment_id("report-figures")).info.run_id
    publish(report, tmp_path / "report", log_metrics=lambda metrics: tracking.log_metrics_now(run_id, metrics),
            log_artifact=lambda path: mlflow_client.log_artifact(run_id, str(path), artifact_path="evaluation"))

    logged = mlflow_client.get_run(run_id).data.metrics
    page = Path(mlflow_client.download_artifacts(run_id, "evaluation/report.html", str(tmp_path / "back")))
    cells = FigureCells()
    cells.feed(page.read_text())
    assert {name: value for name, (value, _) in cells.cells.items()} == logged
    for name, (value, shown) in cells.cells.items():
        metric = name.removeprefix("champion_").removeprefix("baseline_").removeprefix("test_")
        assert shown == report.figures.format(metric, logged[name])
        assert f" {shown}" in report.text()  # the task log's summary shows it too
    assert json.loads((tmp_path / "report" / "metrics.json").read_text()) == logged

    # The figures are the scored metrics: every challenger metric, the champion's, and the baseline's gate metrics.
    challenger = report.figures.column("challenger").values
    assert {n.removeprefix("test_"): v for n, v in logged.items() if n.startswith("test_")} == pytest.approx(challenger)
    champion = report.figures.column("champion")
    assert any(n.startswith("champion_test_") for n in logged) == (champion is not None)
    baseline = {n.removeprefix("baseline_test_") for n in logged if n.startswith("baseline_test_")}
    assert baseline and baseline <= set(report.figures.directions)


def test_the_majority_class_baseline_is_the_split_s_majority_rate():
    report = reports.report("tabular_mlp")
    assert report.figures.value("baseline", "accuracy") == report.figures.value("challenger", "majority_rate")
    assert report.figures.column("baseline").label == "majority class (baseline)"
