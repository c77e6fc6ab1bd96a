"""The supervisor's policy for a deferred task (``launch.<kind>.deferrable``): an attempt split around
Airflow's triggerer, so that no worker slot waits for the job.

``start`` (on a worker) begins the attempt as the supervisor does (``pipeline.job.attempts.begin``), submits it
to the place and defers to ``AttemptTrigger``; ``complete`` (on a worker again) tears the attempt down whatever
the event says, ends it as the supervisor does (``attempts.close``) and asks the one restart decision
(``attempts.verdict``): rank 0's result, a user error (the operator fails without retries), a replacement attempt
while ``launch.max_restarts`` allows (deferred in its turn), or the failure (retryable). Only a
``pipeline.job.places.DeferrablePlace`` defers.
"""

from __future__ import annotations

import time
from typing import Any, NoReturn

from pipeline.airflow.connections import AirflowClusters
from pipeline.job import attempts
from pipeline.job.places import deferrable_place
from pipeline.job.policy import Ended
from pipeline.job.spec import Attempt, JobSpec
from pipeline.job.supervisor import METRICS_FLUSH_TIMEOUT_S


def start(operator, spec: JobSpec, *, restart: int, started: float) -> NoReturn:
    from pipeline.airflow.trigger import AttemptTrigger

    attempt = Attempt(spec, restart)
    place = deferrable_place(spec, AirflowClusters())
    store = attempts.begin(attempt)
    place.submit(attempt, operator.log.info)
    operator.log.info("waiting in the triggerer for attempt %d of %s", restart + 1, spec.name)
    operator.defer(
        trigger=AttemptTrigger(watch=place.watch, handle=place.handle(attempt), timeout_s=spec.launch.timeout_s,
                               stall_timeout_s=spec.launch.stall_timeout_s, progress_dir=str(spec.files.progress),
                               created_at=time.time(), metrics=_metrics(spec),
                               telemetry={"path": str(spec.files.telemetry), "ratio": spec.launch.straggler_ratio,
                                          "windows": spec.launch.straggler_windows}, store=store and store.uri),
        method_name="execute_complete", kwargs={"restart": restart, "started": started},
    )
    raise AssertionError("unreachable: defer raises TaskDeferred")


def complete(operator, spec: JobSpec, event: dict[str, Any], *, restart: int, started: float,
             metrics_flush_timeout_s: float = METRICS_FLUSH_TIMEOUT_S) -> dict | None:
    """Back from the triggerer: tear down, send the metrics the triggerer did not (for up to
    ``metrics_flush_timeout_s``), then the result, or a replacement attempt, or the error."""
    from pipeline.registry.metrics_relay import flushed

    attempt = Attempt(spec, restart)
    place = deferrable_place(spec, AirflowClusters())
    place.teardown(attempt, spec.launch.grace_period_s)
    operator.log.info("attempt %d of %s torn down", restart + 1, spec.name)
    end = Ended(str(event.get("status")), str(event.get("message", "")))
    attempts.close(attempt, end.status, started=float(event.get("started_at") or time.time()),
                   store=attempts.store_of(spec))
    metrics = flushed(spec, metrics_flush_timeout_s, operator.log.info)
    decision = attempts.verdict(attempt, end)
    if decision.action == "restart":
        operator.log.info("%s", decision.notice)
        start(operator, spec, restart=restart + 1, started=started)
    for line in attempts.closing_lines(spec):  # the run's end, as the supervisor's: finished or failed
        operator.log.info("%s", line)
    if decision.action == "finish":
        return metrics.into(spec.files.read_result())
    raise decision.error


def _metrics(spec: JobSpec) -> dict[str, str] | None:
    """What the triggerer needs to relay rank 0's metrics file to the job's MLflow run while it waits."""
    if not spec.env.get("MLFLOW_RUN_ID"):
        return None
    return {"path": str(spec.files.metrics), "run_id": spec.env["MLFLOW_RUN_ID"],
            "tracking_uri": spec.env.get("MLFLOW_TRACKING_URI", "")}
