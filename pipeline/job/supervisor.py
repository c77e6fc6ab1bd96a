"""One supervision policy for every place a job runs (``launch.kind``), written once.

A place only starts, polls and stops one attempt (``Place``); what every place guarantees is here:

- attempts: a failed attempt is replaced while ``launch.max_restarts`` allows, and the next one resumes
  from the job folder's checkpoints; each attempt starts without the last one's heartbeats, errors and
  preemption marker;
- the run timeout (``launch.timeout_s``) and the stall watchdog (``launch.stall_timeout_s``, on the
  ranks' heartbeats; its clock starts at the first one: imports and set-up are not steps);
- error kinds (``outcome``): a rank's user error fails at once, never restarted nor retried; a preempted
  attempt (every rank checkpointed on SIGTERM and exited with ``PREEMPTED_EXIT_CODE``) and any other
  failure are restarted, then retryable; a stall, a timeout, an attempt that never got running and a
  stop from outside are not restarted: the task retry decides;
- live logs: every line the place emits reaches the task log as it comes, and an error ends with the
  last of them;
- live metrics: rank 0's metrics file in the job folder goes to the job's MLflow run (``MLFLOW_RUN_ID``) while
  the job runs, and for up to ``metrics_flush_timeout_s`` after it (``pipeline.registry.relay``): ranks never
  import MLflow;
- teardown: whatever ends an attempt (its end, a timeout, a stall, ``stop()`` from any thread, SIGTERM
  or SIGINT of the task process), the place's ``stop`` has run before the attempt returns.

``pipeline.airflow.deferred`` applies the same policy around Airflow's triggerer.
"""

from __future__ import annotations

import collections
import logging
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from pipeline.errors import (NotStarted, TrainingFailed, TrainingPreempted, TrainingStalled, TrainingStopped,
                             TrainingTimedOut, reported_user_error)
from pipeline.job.spec import JobSpec, attempt_id
from pipeline.train.progress import read_heartbeats

log = logging.getLogger(__name__)

Emit = Callable[[str], None]
TAIL_LINES = 60
POLL_S = 0.5
METRICS_FLUSH_TIMEOUT_S = 120.0
STOPPED = "the training job was stopped (the task was killed, cleared or timed out)"
# Set once this process has launched a job and waits for it: its interpreter is idle then. A process that runs
# tasks itself (``make demo``) does its warm-up from that moment (``pipeline.airflow.warm``).
WAITING = threading.Event()


@dataclass(frozen=True)
class Attempt:
    """The ``restart``-th start of one try of a job."""

    spec: JobSpec
    restart: int

    @property
    def name(self) -> str:
        """Unique per DAG run, task, try and restart: rendezvous ids, the place's object names."""
        return f"{self.spec.name}-{self.restart}"

    @property
    def id(self) -> str:
        """The same, DNS-1123 and at most 52 characters: a place's object names and idempotency keys."""
        return attempt_id(self.spec.name, self.spec.labels, self.restart)

    @property
    def log_dir(self) -> Path:
        """torchrun's per-rank logs and ``@record`` error files of this attempt."""
        return self.spec.files.logs(self.spec.try_number) / f"torchrun-{self.restart}"

    def env(self) -> dict[str, str]:
        """The ranks' environment, the same on every place: the job's own variables, the job folder's
        paths, the process-group backend, and which try and restart this is."""
        spec = self.spec
        return {**spec.env, **spec.files.env(), "PIPELINE_TRY_NUMBER": str(spec.try_number),
                "PIPELINE_RESTART_COUNT": str(self.restart), "PIPELINE_BACKEND": spec.launch.backend}


@dataclass(frozen=True)
class Ended:
    """How an attempt ended. ``status``: ``succeeded``, ``failed``, ``not_started`` (it never got running:
    unschedulable, an image that cannot be pulled), ``timeout``, ``stalled`` or ``stopped``; ``message``
    says how, in the place's words."""

    status: str
    message: str = ""


class Place(Protocol):
    """Where attempts run. Nothing here decides what an ending means: ``outcome`` does. A place whose engine
    restarts failed ranks within an attempt (``restarts_itself``: Ray Train) gets no restarts from here."""

    def start(self, attempt: Attempt, emit: Emit) -> None:
        """Start the attempt; its output lines go to ``emit`` (from any thread), prefixed with rank or node."""

    def poll(self) -> Ended | None:
        """How the attempt ended, or None while it runs."""

    def stop(self, grace_period_s: float) -> None:
        """End the attempt for good, from any thread, any number of times: SIGTERM (or the place's
        equivalent), ``grace_period_s``, then a kill; nothing of it is left when this returns."""

    def dump_stacks(self, beats: dict[int, dict[str, Any]], emit: Emit) -> None:
        """Ask the ranks of a stalled attempt for their stack traces, where the place can reach them."""


def max_restarts(place: Place, launch) -> int:
    """How many times the supervisor replaces a failed attempt on this place."""
    return 0 if getattr(place, "restarts_itself", False) else launch.max_restarts


def begin_attempt(attempt: Attempt) -> None:
    """The job folder as an attempt expects it: the previous attempt's heartbeats, user errors and
    preemption marker are not this one's; a previous try's result is never reported."""
    files = attempt.spec.files
    files.root.mkdir(parents=True, exist_ok=True)
    if attempt.restart == 0:
        files.result.unlink(missing_ok=True)
    for folder in (files.progress, files.errors):
        shutil.rmtree(folder, ignore_errors=True)
    files.progress.mkdir(parents=True)


class Watchdog:
    """The run timeout and the stall clock of one attempt, on any clock (monotonic on a worker, wall
    time in the triggerer, which may run elsewhere)."""

    def __init__(self, *, timeout_s: float, stall_timeout_s: float, progress_dir: Path, started: float):
        self.timeout_s, self.stall_timeout_s, self.progress_dir = timeout_s, stall_timeout_s, Path(progress_dir)
        self.started = self.last_change = started
        self.last: dict = {}
        self.beats: dict[int, dict[str, Any]] = {}

    def check(self, now: float) -> Ended | None:
        if now - self.started > self.timeout_s:
            return Ended("timeout", f"training ran past launch.timeout_s={self.timeout_s:g}s and was stopped")
        if not self.stall_timeout_s:
            return None
        self.beats = read_heartbeats(self.progress_dir)
        progress = {rank: {k: v for k, v in beat.items() if k != "time"} for rank, beat in self.beats.items()}
        if progress != self.last:
            self.last, self.last_change = progress, now
        elif progress and now - self.last_change > self.stall_timeout_s:
            return Ended("stalled", describe_stall(self.beats, now - self.last_change, self.stall_timeout_s))
        return None


def outcome(end: Ended, attempt: Attempt, tail: list[str] = ()) -> Exception | None:
    """What an attempt's end means: None for success, else the error to restart on or to raise."""
    from pipeline.train.progress import read_preemption

    files = attempt.spec.files
    last_lines = "\nlast output lines:\n" + "\n".join(tail) if tail else ""
    if end.status == "succeeded":
        return None
    if end.status == "stopped":
        return TrainingStopped(end.message or STOPPED)
    if end.status == "timeout":
        return TrainingTimedOut(end.message)
    if end.status == "stalled":
        return TrainingStalled(end.message + last_lines)
    if end.status == "not_started":
        return NotStarted(end.message)
    user_error = reported_user_error(files.errors)
    if user_error is not None:
        return user_error  # bad config or data: a restart or a retry would fail the same way
    preempted = read_preemption(files.progress)
    if preempted is not None:
        return TrainingPreempted(f"the ranks were sent SIGTERM (an eviction or a stop) and checkpointed at step "
                                 f"{preempted['step']}; {end.message}")
    failure = rank_failure(attempt.log_dir)
    return TrainingFailed(end.message + (f"; {failure}" if failure else "") + last_lines)


class Supervisor:
    """Runs a job on a place under the policy above. ``run()`` blocks and returns rank 0's result;
    ``stop()`` may come from any thread (``on_kill``, a signal)."""

    def __init__(self, spec: JobSpec, place: Place, *, poll_s: float | None = None,
                 metrics_flush_timeout_s: float = METRICS_FLUSH_TIMEOUT_S):
        self.spec, self.place = spec, place
        self.poll_s = poll_s or getattr(place, "poll_s", POLL_S)
        self.metrics_flush_timeout_s = metrics_flush_timeout_s
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

    def run(self, emit: Emit | None = None) -> dict[str, Any] | None:
        """Rank 0's result, with ``unsent_metrics`` where the job has an MLflow run to relay its metrics to."""
        from pipeline.registry.relay import relaying

        emit = self._logger(emit or log.info)
        previous = _forward_termination(self.stop)
        try:
            with relaying(self.spec, self.metrics_flush_timeout_s, emit) as metrics:
                result = self._attempts(emit)
            return metrics.into(result)
        finally:
            _restore(previous)

    def _attempts(self, emit: Emit) -> dict[str, Any] | None:
        restarts = max_restarts(self.place, self.spec.launch)
        for restart in range(restarts + 1):
            error = self._attempt(Attempt(self.spec, restart), emit)
            if error is None:
                return self.spec.files.read_result()
            if not getattr(error, "restartable", False) or restart == restarts or self._stopped.is_set():
                raise error
            emit(f"{str(error).splitlines()[0]}; restarting every rank ({restart + 1} of {restarts}); "
                 f"training resumes from its last checkpoint")
        raise AssertionError("unreachable: the last attempt returns or raises")

    def stop(self) -> None:
        """Stop for good: the current attempt is torn down now and no other starts."""
        self._stopped.set()
        self.place.stop(self.spec.launch.grace_period_s)

    def _attempt(self, attempt: Attempt, emit: Emit) -> Exception | None:
        if self._stopped.is_set():
            return TrainingStopped(STOPPED)
        begin_attempt(attempt)
        self._tail.clear()
        try:
            self.place.start(attempt, emit)
            end = self._wait(emit)
        finally:
            self.place.stop(self.spec.launch.grace_period_s)  # whatever ended the wait, nothing outlives it
        if self._stopped.is_set() and end.status != "succeeded":
            end = Ended("stopped", STOPPED)
        return outcome(end, attempt, list(self._tail))

    def _wait(self, emit: Emit) -> Ended:
        WAITING.set()
        launch = self.spec.launch
        watchdog = Watchdog(timeout_s=launch.timeout_s, stall_timeout_s=launch.stall_timeout_s,
                            progress_dir=self.spec.files.progress, started=time.monotonic())
        while True:
            end = self.place.poll()
            if end is not None:
                return end
            if self._stopped.is_set():
                return Ended("stopped", STOPPED)
            verdict = watchdog.check(time.monotonic())
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


def rank_failure(log_dir: Path) -> str | None:
    """The failing rank's traceback from torchrun's error files (written by ``@record``), newest first."""
    import json

    files = sorted(Path(log_dir).glob("**/error.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in files:
        try:
            message = json.loads(path.read_text())["message"]
        except (OSError, ValueError, KeyError):
            continue
        if isinstance(message, dict):
            stack = message.get("extraInfo", {}).get("py_callstack") or message.get("message", "")
        else:
            stack = str(message)
        local_rank, attempt = path.parent.name, path.parent.parent.name
        stack = stack.rstrip()
        last = stack.rpartition("\n")[2].strip()  # the exception's own line first: a restart's notice says why
        return f"local rank {local_rank} failed ({attempt.replace('_', ' ')}): {last}\n{stack}"
    return None


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


def place_for(spec: JobSpec) -> Place:
    """The place of ``launch.kind``, checked against the job's launch settings."""
    import importlib

    from pipeline.errors import ConfigError
    from pipeline.job.spec import PLACES

    kind = spec.launch.kind
    if kind not in PLACES:
        raise ConfigError(f"launch.kind={kind!r}: expected one of {sorted(PLACES)}")
    if spec.launch.min_nnodes > spec.launch.nnodes:
        raise ConfigError(f"launch.min_nnodes={spec.launch.min_nnodes}: expected at most launch.nnodes="
                          f"{spec.launch.nnodes} (0 for a job of exactly nnodes nodes)")
    module, _, attr = PLACES[kind].partition(":")
    return getattr(importlib.import_module(module), attr)(spec)


class Job:
    """A job spec bound to its place and supervisor: ``run()`` blocks and returns rank 0's result;
    ``stop()`` from anywhere."""

    def __init__(self, spec: JobSpec, *, metrics_flush_timeout_s: float = METRICS_FLUSH_TIMEOUT_S):
        self.spec = spec
        self.supervisor = Supervisor(spec, place_for(spec), metrics_flush_timeout_s=metrics_flush_timeout_s)

    def run(self, emit: Emit | None = None) -> dict[str, Any] | None:
        return self.supervisor.run(emit)

    def stop(self) -> None:
        self.supervisor.stop()
