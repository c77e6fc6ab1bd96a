"""One supervision policy for every place a job runs (``launch.kind``).

A place only starts, polls and stops one attempt (``pipeline.job.places.Place``); what every place guarantees is here:

- attempts: what an ended attempt means and whether it is restarted is ``pipeline.job.policy.decide`` (a rank's
  user error fails at once; a preempted or failed attempt is restarted while ``launch.max_restarts`` allows, and
  the next one resumes from the job folder's checkpoints; a stall, a timeout, an attempt that never got running
  and a stop from outside are left to the task retry); each attempt starts without the last one's heartbeats,
  errors and preemption marker; how an attempt begins and ends is ``pipeline.job.attempts``'s, with one restart
  count per run on every place;
- the run timeout (``launch.timeout_s``) and the stall watchdog (``launch.stall_timeout_s``, on the
  ranks' heartbeats; its clock starts at the first one: imports and set-up are not steps);
- live logs: every line the place emits reaches the task log as it comes, and an error ends with the
  last of them;
- live metrics: rank 0's metrics file in the job folder goes to the job's MLflow run (``MLFLOW_RUN_ID``) while
  the job runs, and for up to ``metrics_flush_timeout_s`` after it (``pipeline.registry.metrics_relay``): ranks never
  import MLflow;
- every rank's figures, read from the heartbeats as they come: per-rank metrics beside rank 0's, stragglers named
  in the log, the run's per-rank summary at the end (``pipeline.job.telemetry``); each attempt's hours and cost
  recorded when it ends, the run's at the end (``pipeline.job.cost``); ``attempts.run_figures`` reads them back;
- pruning: a ``pruner`` (a sweep's, ``pipeline.sweep.pruning``) asked on every poll; a reason it returns stops the
  job as ``pruned`` (``TrainingPruned``: not a failure, never restarted);
- nodes that share no folder (``PIPELINE_JOB_STORE``): the job folder's copy on the object store is pulled as the
  job is polled and after each attempt (``pipeline.job.mirror``);
- teardown: whatever ends an attempt (its end, a timeout, a stall, ``stop()`` from any thread, SIGTERM
  or SIGINT of the task process), the place's ``stop`` has run before the attempt returns.

``pipeline.airflow.deferred`` applies the same policy around Airflow's triggerer, with the same beginning and
end of an attempt (``pipeline.job.attempts``).
"""

from __future__ import annotations

import collections
import signal
import threading
import time
import logging
from pathlib import Path
from typing import Any, Callable

from pipeline.job import attempts, telemetry
from pipeline.job.attempts import run_figures, run_tags  # noqa: F401 - the stages' interface (pipeline.stages)
from pipeline.job.places import Clusters, Place, place_for
from pipeline.job.policy import STOPPED, Decision, Ended, Findings, decide
from pipeline.job.spec import Attempt, JobSpec, resolve
from pipeline.job_files import read_heartbeats

log = logging.getLogger(__name__)

Emit = Callable[[str], None]
Pruner = Callable[[], "str | None"]  # asked on every poll: a reason to stop the job as pruned, or None
TAIL_LINES = 60
POLL_S = 0.5
METRICS_FLUSH_TIMEOUT_S = 120.0


class Watchdog:
    """The run timeout and the stall clock of one attempt, on any clock (monotonic on a worker, wall
    time in the triggerer, which may run elsewhere)."""

    def __init__(self, *, timeout_s: float, stall_timeout_s: float, progress_dir: Path, started: float):
        self.timeout_s, self.stall_timeout_s, self.progress_dir = timeout_s, stall_timeout_s, Path(progress_dir)
        self.started = self.last_change = started
        self.last: dict = {}
        self.beats: dict[int, dict[str, Any]] = {}

    def check(self, now: float) -> Ended | None:
        self.beats = read_heartbeats(self.progress_dir)  # the stall clock's, and the telemetry's
        if now - self.started > self.timeout_s:
            return Ended("timeout", f"training ran past launch.timeout_s={self.timeout_s:g}s and was stopped")
        if not self.stall_timeout_s:
            return None
        progress = {rank: {k: v for k, v in beat.items() if k not in ("time", "windows")}
                    for rank, beat in self.beats.items()}
        if progress != self.last:
            self.last, self.last_change = progress, now
        elif progress and now - self.last_change > self.stall_timeout_s:
            return Ended("stalled", describe_stall(self.beats, now - self.last_change, self.stall_timeout_s))
        return None


class Supervisor:
    """Runs a job on a place under the policy above. ``run()`` blocks and returns rank 0's result;
    ``stop()`` may come from any thread (``on_kill``, a signal)."""

    def __init__(self, spec: JobSpec, place: Place, *, poll_s: float | None = None,
                 metrics_flush_timeout_s: float = METRICS_FLUSH_TIMEOUT_S, pruner: Pruner | None = None):
        self.spec, self.place, self.pruner = spec, place, pruner
        self.poll_s = poll_s or place.poll_s
        self.metrics_flush_timeout_s = metrics_flush_timeout_s
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.telemetry = telemetry_of(spec)
        self.store = attempts.store_of(spec)  # nodes that share no folder: its copy

    def run(self, emit: Emit | None = None) -> dict[str, Any] | None:
        """Rank 0's result, with ``unsent_metrics`` where the job has an MLflow run to relay its metrics to."""
        from pipeline.registry.metrics_relay import relaying

        emit = self._logger(emit or log.info)
        previous = _forward_termination(self.stop)
        try:
            with relaying(self.spec, self.metrics_flush_timeout_s, emit) as metrics:
                try:
                    result = self._run_attempts(emit)
                finally:
                    for line in attempts.closing_lines(self.spec):
                        emit(line)
            return metrics.into(result)
        finally:
            _restore(previous)

    def _run_attempts(self, emit: Emit) -> dict[str, Any] | None:
        restart = 0
        while True:
            decision = self._attempt(Attempt(self.spec, restart), emit)
            if decision.action == "finish":
                return self.spec.files.read_result()
            if decision.action == "fail":
                raise decision.error
            emit(decision.notice)
            restart += 1

    def stop(self) -> None:
        """Stop for good: the current attempt is torn down now and no other starts."""
        self._stopped.set()
        self.place.stop(self.spec.launch.grace_period_s)

    def _attempt(self, attempt: Attempt, emit: Emit) -> Decision:
        if self._stopped.is_set():
            return decide(Ended("stopped", STOPPED), Findings(), restart=attempt.restart, max_restarts=0)
        attempts.begin(attempt)
        self._tail.clear()
        self.telemetry.new_attempt()
        started, end = time.time(), Ended("failed", "the attempt did not start")
        try:
            self.place.start(attempt, emit)
            end = self._wait(emit)
        finally:
            self.place.stop(self.spec.launch.grace_period_s)  # whatever ended the wait, nothing outlives it
            beats = attempts.close(attempt, end.status, started=started, store=self.store)
            for line in self.telemetry.update(beats):  # the last windows
                emit(line)
        if self._stopped.is_set() and end.status != "succeeded":
            end = Ended("stopped", STOPPED)
        return attempts.verdict(attempt, end, tail=list(self._tail))

    def _wait(self, emit: Emit) -> Ended:
        launch = self.spec.launch
        watchdog = Watchdog(timeout_s=launch.timeout_s, stall_timeout_s=launch.stall_timeout_s,
                            progress_dir=self.spec.files.progress, started=time.monotonic())
        while True:
            end = self.place.poll()
            if end is not None:
                return end
            if self._stopped.is_set():
                return Ended("stopped", STOPPED)
            if self.store:
                self.store.pull(self.spec.files)
            verdict = watchdog.check(time.monotonic())
            for line in self.telemetry.update(watchdog.beats):
                emit(line)
            reason = self.pruner() if self.pruner is not None and verdict is None else None
            if reason:
                verdict = Ended("pruned", reason)
            if verdict is not None:
                emit(verdict.message)
                if verdict.status == "stalled":
                    emit("asking every rank for its stack traces (they follow, with rank prefixes)")
                    self.place.dump_stacks(watchdog.beats, emit)
                return verdict
            time.sleep(self.poll_s)

    def _logger(self, emit: Emit) -> Emit:
        def line(text: str) -> None:
            with self._lock:  # one line at a time, from the place's reader threads
                self._tail.append(text)
                emit(text)

        return line


def describe_stall(beats: dict[int, dict[str, Any]], idle_s: float, stall_timeout_s: float) -> str:
    where = "; ".join(
        f"rank {rank}: step {beat['step']}" + (f"/{beat['total']}" if beat.get("total") else "")
        + (f" epoch {beat['epoch']}" if beat.get("epoch") is not None else "") + f" ({beat['phase']}, pid {beat['pid']})"
        for rank, beat in sorted(beats.items())
    )
    return (f"training stalled: no step completed for {idle_s:.0f}s (launch.stall_timeout_s={stall_timeout_s:g}); "
            f"last reported positions: {where}")


def _forward_termination(stop: Callable[[], None]):
    """SIGTERM/SIGINT of this process (a worker shutting down) stops the job first; main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        stop()
        previous_handler = previous.get(signum)
        if callable(previous_handler):
            previous_handler(signum, frame)
        else:
            raise SystemExit(128 + signum)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, handler)
    return previous


def _restore(previous) -> None:
    if previous:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def telemetry_of(spec: JobSpec) -> telemetry.RankTelemetry:
    """The job's per-rank telemetry, as its ``launch`` section asks."""
    return telemetry.RankTelemetry(spec.files.telemetry, ratio=spec.launch.straggler_ratio,
                                   windows=spec.launch.straggler_windows)


class Job:
    """A job spec, resolved (``pipeline.job.spec.resolve``), bound to its place and supervisor: ``run()`` blocks
    and returns rank 0's result; ``stop()`` from anywhere. ``clusters``: how the place reaches a cluster named by a
    connection (``pipeline.job.places.Clusters``), handed in by the Airflow layer."""

    def __init__(self, spec: JobSpec, *, clusters: Clusters | None = None,
                 metrics_flush_timeout_s: float = METRICS_FLUSH_TIMEOUT_S, pruner: Pruner | None = None):
        self.spec = resolve(spec)
        self.supervisor = Supervisor(self.spec, place_for(self.spec, clusters),
                                     metrics_flush_timeout_s=metrics_flush_timeout_s, pruner=pruner)

    def run(self, emit: Emit | None = None) -> dict[str, Any] | None:
        return self.supervisor.run(emit)

    def stop(self) -> None:
        self.supervisor.stop()
