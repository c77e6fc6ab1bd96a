"""The evaluator interface the evaluate stage calls, the same for classifiers, retrieval and language models.

Light: no mlflow or torch at import (a recipe's ``TrainSpec`` names its evaluator).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Protocol, runtime_checkable

# What ``score`` returns for one model: ``{"metrics": {name: value}, "details": {...}}``; the stage adds
# ``"version"`` and hands ``{"challenger": ..., "champion": ... or None}`` of these to the report.
Scored = dict[str, Any]


@runtime_checkable
class Evaluator(Protocol):
    # Metric -> higher is better: what the gate may compare (``evaluate.metric``, ``evaluate.guardrails``).
    metrics: Mapping[str, bool]
    # Metrics of the challenger's MLflow run whose history the report plots.
    history_keys: tuple[str, ...]

    def score(self, model_uri: str, inputs: Any, labels: Any, cfg: Any, /) -> Scored:
        """Load the registered model at ``model_uri`` and score it on ``inputs`` against ``labels`` (what the
        recipe's ``evaluation_inputs`` returned); ``cfg`` is the run's config."""
        ...

    def write_report(self, out_dir: Path, *, model_name: str, classes: list, scored: Mapping[str, Scored | None],
                     history: dict[str, list[tuple[int, float]]], decision: dict[str, Any]) -> list[Path]:
        """Write the report (``report.html`` among them) into ``out_dir``; return the files written."""
        ...

    def text_summary(self, classes: list, scored: Mapping[str, Scored | None], decision: dict[str, Any]) -> str:
        """A compact text version of the report for the task log."""
        ...


def predict(model_uri: str, inputs: Any) -> Any:
    """The output of the registered model at ``model_uri`` for ``inputs``, loaded as its users load it (pyfunc)."""
    import mlflow.pyfunc

    return mlflow.pyfunc.load_model(model_uri).predict(inputs)
