"""The beginning and the end of one attempt, and the run's closing figures, for whoever supervises it: the
task's supervisor (``pipeline.job.supervisor``) and a deferred task, whose attempt is split around Airflow's
triggerer (``pipeline.airflow.deferred``).

- ``begin``: the job folder as the attempt expects it (``JobFiles.begin_attempt``), and its copy on the object
  store where the nodes share no folder (``pipeline.job.mirror``);
- ``close``: what the nodes wrote last pulled from that copy, the attempt's hours and cost recorded
  (``pipeline.job.cost``);
- ``verdict``: the one restart decision (``pipeline.job.policy.decide``) on what the ranks left in the job folder,
  with ``launch.max_restarts``: every place's restarts are the supervisor's, so a run has one restart count;
- ``run_figures`` / ``closing_lines``: every rank's figures and the cost of the whole run, read back from the job
  folder (every attempt's, whichever worker or triggerer ran it).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from pipeline.job import cost, telemetry
from pipeline.job.mirror import JobStore
from pipeline.job.policy import Decision, Ended, Findings, decide
from pipeline.job.spec import Attempt, JobSpec
from pipeline.job_files import read_heartbeats


def store_of(spec: JobSpec) -> JobStore | None:
    """The job folder's copy on the object store, where the job's nodes share no folder with its supervisor."""
    return JobStore.for_job(spec.job_dir, spec.launch.kind)


def begin(attempt: Attempt) -> JobStore | None:
    """Prepare the job folder (and its copy) for ``attempt``: the previous attempt's heartbeats, errors and
    preemption marker are not this one's. Returns the copy, if the job has one."""
    spec = attempt.spec
    spec.files.begin_attempt(attempt.restart)
    store = store_of(spec)
    if store:
        store.begin_attempt(spec.files)
    return store


def close(attempt: Attempt, status: str, *, started: float, store: JobStore | None) -> dict[int, dict[str, Any]]:
    """Once the attempt's ranks are gone: pull what the nodes wrote last (result, errors, preemption marker) and
    record the attempt's cost. Returns the ranks' last heartbeats (the telemetry's last windows)."""
    files = attempt.spec.files
    if store:
        store.pull(files, now=True)
    beats = read_heartbeats(files.progress)
    cost.record(files.attempts, attempt.spec.launch, started=started, ended=time.time(), ranks=len(beats),
                status=status, try_number=attempt.spec.try_number, restart=attempt.restart)
    return beats


def verdict(attempt: Attempt, end: Ended, tail: Sequence[str] = ()) -> Decision:
    """Whether the run finishes, restarts or fails after ``attempt`` ended as ``end``."""
    return decide(end, Findings.read(attempt.spec.files, attempt.log_dir), restart=attempt.restart,
                  max_restarts=attempt.spec.launch.max_restarts, tail=tail)


def run_figures(files) -> dict[str, Any]:
    """The run's per-rank figures and stragglers (``ranks``, ``stragglers``: where the ranks reported any) and its
    cost (``cost``), read back from the job folder ``files``."""
    ranks, spent = telemetry.summarize(files.telemetry), cost.summarize(files.attempts)
    return (ranks if ranks["ranks"] or ranks["nodes"] else {}) | ({"cost": spent} if spent else {})


def run_tags(figures: dict[str, Any]) -> dict[str, str]:
    """``run_figures`` as MLflow tags: ``stragglers`` and ``cost.*`` (``cost.summary``: its line)."""
    tags = {"stragglers": telemetry.describe_stragglers(figures["stragglers"])} if "stragglers" in figures else {}
    if figures.get("cost"):
        tags |= cost.tags(figures["cost"]) | {"cost.summary": cost.describe(figures["cost"])}
    return tags


def figure_lines(figures: dict[str, Any]) -> list[str]:
    """``run_figures`` for the task log."""
    lines = [telemetry.summary_line(figures) if "ranks" in figures else None, cost.describe(figures.get("cost"))]
    return [line for line in lines if line]


def closing_lines(spec: JobSpec) -> list[str]:
    """The lines that end a run's task log, however the run ended."""
    return figure_lines(run_figures(spec.files))
