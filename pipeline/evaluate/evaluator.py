"""The evaluator interface the evaluate stage calls, the same for classifiers, retrieval and language models.

Light: no mlflow or torch at import (a recipe's ``TrainSpec`` names its evaluator).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pipeline.evaluate.report.document import History, Section

# What ``score`` returns for one model: ``{"metrics": {name: value}, "details": {...}}``; ``details["baseline"]``,
# when there is one, holds the baseline's metrics on the same rows. The stage adds ``"version"`` and hands
# ``{"challenger": ..., "champion": ... or None}`` of these to the report.
Scored = dict[str, Any]


@runtime_checkable
class Evaluator(Protocol):
    # Metric -> higher is better: what the gate may compare (``evaluate.metric``, ``evaluate.guardrails``).
    metrics: Mapping[str, bool]
    # Metrics of each model's MLflow run whose history the report plots.
    history_keys: tuple[str, ...]
    # What the report shows beside the models ("majority class", "popularity", "model before training"), or None.
    baseline: str | None

    def score(self, model_uri: str, inputs: Any, labels: Any, cfg: Any, /) -> Scored:
        """Load the registered model at ``model_uri`` and score it on ``inputs`` against ``labels`` (what the
        recipe's ``evaluation_inputs`` returned); ``cfg`` is the run's config."""
        ...

    def report_sections(self, classes: list, scored: Mapping[str, Scored | None], history: History, /) -> list[Section]:
        """The recipe's part of the report (``pipeline.evaluate.report``): its tables, plots and samples, with
        the champion beside the challenger in each."""
        ...


def predict(model_uri: str, inputs: Any, params: dict[str, Any] | None = None) -> Any:
    """The output of the registered model at ``model_uri`` for ``inputs`` (and the request's ``params``), loaded
    as its users load it (pyfunc)."""
    import mlflow.pyfunc

    return mlflow.pyfunc.load_model(model_uri).predict(inputs, params=params)
