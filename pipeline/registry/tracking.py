"""MLflow tracking: the client, the run that lineage hangs on (one per DAG run), and outages."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
from pathlib import Path
from typing import Any, Iterator

from pipeline import deployment
from pipeline.errors import InfraError

log = logging.getLogger(__name__)

RUN_KEY_TAG = "pipeline.run_key"

# The task process fails fast on an unreachable server (~7 s) and Airflow retries the task;
# MLflow's own default keeps retrying for about two minutes. Users' settings win.
_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                  "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


def client(uri: str | None = None):
    """An ``MlflowClient`` on ``uri``, by default the configured tracking URI (SQLite under the project)."""
    import mlflow
    from mlflow import MlflowClient

    for key, value in _HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    uri = uri or deployment.mlflow_tracking_uri()
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    return MlflowClient(tracking_uri=uri)


@contextlib.contextmanager
def reachable(action: str) -> Iterator[None]:
    """Turn "the tracking server did not answer" into a retryable ``InfraError`` saying so."""
    try:
        yield
    except Exception as exc:
        if not is_unreachable(exc):
            raise
        raise InfraError(
            f"MLflow tracking server at {deployment.mlflow_tracking_uri()} is unreachable while trying to "
            f"{action}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}; the task will be retried"
        ) from exc


def is_unreachable(exc: BaseException) -> bool:
    import requests
    from mlflow.exceptions import MlflowException

    if isinstance(exc, (requests.ConnectionError, requests.Timeout, ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, MlflowException):
        text = str(exc)
        return any(marker in text for marker in (
            "Max retries exceeded", "Connection refused", "TEMPORARILY_UNAVAILABLE", "Read timed out",
            "Failed to establish a new connection", "API request to",
        ))
    return False


def experiment_id(name: str) -> str:
    """The experiment's id, creating it with the project's artifact root when missing."""
    mlflow_client = client()
    experiment = mlflow_client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    # A local store keeps artifacts under the project; a tracking server decides for itself
    # unless PIPELINE_MLFLOW_ARTIFACTS says otherwise.
    local = not deployment.mlflow_tracking_uri().startswith(("http://", "https://", "databricks"))
    location = deployment.mlflow_artifact_root() if local or os.environ.get("PIPELINE_MLFLOW_ARTIFACTS") else None
    try:
        return mlflow_client.create_experiment(name, artifact_location=location)
    except Exception:  # created concurrently by another task
        experiment = mlflow_client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def ensure_run(experiment: str, run_key: str, tags: dict[str, str]) -> str:
    """The MLflow run for ``run_key`` (dag_id/run_id), created on first use: retries reuse it.

    ``tags`` are (re)set on every call, so the run shows the latest attempt's try number.
    """
    mlflow_client = client()
    exp_id = experiment_id(experiment)
    found = mlflow_client.search_runs([exp_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'", max_results=1)
    if found:
        run_id = found[0].info.run_id
        for key, value in tags.items():
            mlflow_client.set_tag(run_id, key, value)
        return run_id
    run = mlflow_client.create_run(exp_id, tags={RUN_KEY_TAG: run_key, **tags}, run_name=run_key.replace("/", ":"))
    log.info("created MLflow run %s for %s", run.info.run_id, run_key)
    return run.info.run_id


def experiment_id_of(run_id: str) -> str:
    return client().get_run(run_id).info.experiment_id


def log_params_once(run_id: str, params: dict[str, str]) -> None:
    """Log params not yet on the run (params are write-once; a retried task logs the same ones)."""
    from mlflow.entities import Param

    mlflow_client = client()
    existing = mlflow_client.get_run(run_id).data.params
    fresh = [Param(k, v) for k, v in params.items() if k not in existing]
    for start in range(0, len(fresh), 100):  # MLflow's limit of params per batch
        mlflow_client.log_batch(run_id, params=fresh[start : start + 100])


def log_metrics_now(run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    """Log a few metrics in one call (for stages outside training)."""
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client().log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])


def set_tags(run_id: str, tags: dict[str, str]) -> None:
    """Set (or replace) tags of a run in one call."""
    from mlflow.entities import RunTag

    client().log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


def end_run(run_id: str, status: str) -> None:
    """Mark a run ended (``FINISHED``, ``FAILED``, ``KILLED``)."""
    client().set_terminated(run_id, status)


def log_dataset_input(run_id: str, *, name: str, digest: str, source_uri: str, profile: dict[str, Any]) -> None:
    """Record the dataset version as the run's training input (name, digest, source), once."""
    import json

    from mlflow.entities import Dataset, DatasetInput, InputTag

    mlflow_client = client()
    existing = mlflow_client.get_run(run_id).inputs.dataset_inputs
    if any(d.dataset.digest == digest for d in existing):
        return
    dataset = Dataset(name=name, digest=digest, source_type="local" if source_uri.startswith("file:") else "uri",
                      source=json.dumps({"uri": source_uri}), profile=json.dumps(profile))
    inputs = [DatasetInput(dataset, tags=[InputTag("mlflow.data.context", "training")])]
    try:
        mlflow_client.log_inputs(run_id, datasets=inputs)
    except Exception as exc:
        # Runs of one experiment logging the same dataset at once (a sweep's trials): the store inserts the
        # experiment's dataset row once, and the loser's insert breaks its unique key. Again, it finds the row.
        if not _duplicate_key(exc):
            raise
        log.info("dataset %s@%s was being recorded by another run of the experiment; linking it again", name, digest)
        mlflow_client.log_inputs(run_id, datasets=inputs)


def _duplicate_key(exc: BaseException) -> bool:
    text = str(exc)
    return any(marker in text for marker in ("UniqueViolation", "UNIQUE constraint failed", "duplicate key value"))


def code_version() -> str:
    """``PIPELINE_CODE_VERSION``, else the project's git commit (``-dirty`` with local changes)."""
    if os.environ.get("PIPELINE_CODE_VERSION"):
        return os.environ["PIPELINE_CODE_VERSION"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=deployment.PROJECT_ROOT, capture_output=True,
                             text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=deployment.PROJECT_ROOT,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
