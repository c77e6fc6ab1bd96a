"""MLflow tracking set-up and the run that lineage hangs on (one per DAG run)."""

from __future__ import annotations

import logging
from typing import Any

from pipeline import settings

log = logging.getLogger(__name__)

RUN_KEY_TAG = "pipeline.run_key"


def client():
    """An ``MlflowClient`` on the configured tracking URI (SQLite under the project by default)."""
    import mlflow
    from mlflow import MlflowClient

    uri = settings.mlflow_tracking_uri()
    if uri.startswith("sqlite:///"):
        from pathlib import Path

        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    return MlflowClient(tracking_uri=uri)


def experiment_id(name: str) -> str:
    """The experiment's id, creating it with the project's artifact root when missing."""
    mlflow_client = client()
    experiment = mlflow_client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return mlflow_client.create_experiment(name, artifact_location=settings.mlflow_artifact_root())
    except Exception:  # created concurrently by another task
        experiment = mlflow_client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def ensure_run(experiment: str, run_key: str, tags: dict[str, str]) -> str:
    """The MLflow run for ``run_key`` (dag_id/run_id), created on first use: retries reuse it."""
    mlflow_client = client()
    exp_id = experiment_id(experiment)
    found = mlflow_client.search_runs([exp_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'", max_results=1)
    if found:
        return found[0].info.run_id
    run = mlflow_client.create_run(exp_id, tags={RUN_KEY_TAG: run_key, **tags}, run_name=run_key.replace("/", ":"))
    log.info("created MLflow run %s for %s", run.info.run_id, run_key)
    return run.info.run_id


def flatten(nested: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> ``{"train.learning_rate": "0.003", ...}`` for MLflow params."""
    flat: dict[str, str] = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = str(value)
    return flat
