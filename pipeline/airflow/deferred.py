"""The supervisor's policy for a deferred task (``launch.<kind>.deferrable``): an attempt split around
Airflow's triggerer, so that no worker slot waits for the job.

``start`` (on a worker) prepares the job folder as every attempt does, submits the attempt to the place
and defers to ``AttemptTrigger``; ``complete`` (on a worker again) tears the attempt down whatever the
event says, then applies ``pipeline.job.supervisor.outcome``: rank 0's result, a user error (the
operator fails without retries), a replacement attempt while ``launch.max_restarts`` allows (deferred in
its turn), or the failure (retryable). A place defers when it has ``submit``, ``handle``, ``teardown``
and an async ``watch``.
"""

from __future__ import annotations

import time
from typing import Any, NoReturn

from pipeline.errors import ConfigError
from pipeline.job.spec import JobSpec
from pipeline.job.supervisor import (
    METRICS_FLUSH_TIMEOUT_S,
    Attempt,
    Ended,
    begin_attempt,
    max_restarts,
    outcome,
    place_for,
)


def deferrable_place(spec: JobSpec):
    place = place_for(spec)
    if not hasattr(place, "watch"):
        raise ConfigError(f"launch.kind={spec.launch.kind!r} cannot defer: it runs the ranks as children of the "
                          f"task's own process")
    return place


def start(operator, spec: JobSpec, *, restart: int, started: float) -> NoReturn:
    from pipeline.airflow.trigger import AttemptTrigger

    attempt = Attempt(spec, restart)
    place = deferrable_place(spec)
    begin_attempt(attempt)
    place.submit(attempt, operator.log.info)
    operator.log.info("waiting in the triggerer for attempt %d of %s", restart + 1, spec.name)
    operator.defer(
        trigger=AttemptTrigger(watch=place.watch, handle=place.handle(attempt), timeout_s=spec.launch.timeout_s,
                               stall_timeout_s=spec.launch.stall_timeout_s, progress_dir=str(spec.files.progress),
                               created_at=time.time(), metrics=_metrics(spec)),
        method_name="execute_complete", kwargs={"restart": restart, "started": started},
    )
    raise AssertionError("unreachable: defer raises TaskDeferred")


def complete(operator, spec: JobSpec, event: dict[str, Any], *, restart: int, started: float,
             metrics_flush_timeout_s: float = METRICS_FLUSH_TIMEOUT_S) -> dict | None:
    """Back from the triggerer: tear down, send the metrics the triggerer did not (for up to
    ``metrics_flush_timeout_s``), then the result, or a replacement attempt, or the error."""
    from pipeline.registry.relay import flushed

    attempt = Attempt(spec, restart)
    place = deferrable_place(spec)
    place.teardown(attempt, spec.launch.grace_period_s)
    operator.log.info("attempt %d of %s torn down", restart + 1, spec.name)
    metrics = flushed(spec, metrics_flush_timeout_s, operator.log.info)
    error = outcome(Ended(str(event.get("status")), str(event.get("message", ""))), attempt)
    if error is None:
        return metrics.into(spec.files.read_result())
    restarts = max_restarts(place, spec.launch)
    if getattr(error, "restartable", False) and restart < restarts:
        operator.log.info("%s; restarting every rank (%d of %d); training resumes from its last checkpoint",
                          str(error).splitlines()[0], restart + 1, restarts)
        start(operator, spec, restart=restart + 1, started=started)
    raise error


def _metrics(spec: JobSpec) -> dict[str, str] | None:
    """What the triggerer needs to relay rank 0's metrics file to the job's MLflow run while it waits."""
    if not spec.env.get("MLFLOW_RUN_ID"):
        return None
    return {"path": str(spec.files.metrics), "run_id": spec.env["MLFLOW_RUN_ID"],
            "tracking_uri": spec.env.get("MLFLOW_TRACKING_URI", "")}
