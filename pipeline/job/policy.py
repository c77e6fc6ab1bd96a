"""The one restart decision: what an ended attempt means, and whether it is restarted.

``decide`` is a pure function of how the attempt ended (``Ended``, in the place's words), what its ranks left in
the job folder (``Findings``), how many restarts have happened and how many are allowed. The supervisor
(``pipeline.job.supervisor``) and the deferred completion (``pipeline.airflow.deferred``) ask it through
``pipeline.job.attempts.verdict``; no place decides on its own (Ray Train restarts nothing). The rules:

- success finishes;
- a rank's user error (bad config or data) fails at once: a restart or a retry would fail the same way;
- a preempted attempt (every rank checkpointed on SIGTERM and exited) and any other failure of the ranks are
  restarted while restarts are left, then fail as retryable;
- a stall, a timeout, an attempt that never got running and a stop from outside are never restarted: the task
  retry decides;
- a pruned attempt (a sweep's pruner stopped the job, ``Supervisor(pruner=...)``) is an end of its own: neither
  restarted nor retried, and not a failure (``TrainingPruned``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pipeline.errors import (NotStarted, RankUserError, TrainingFailed, TrainingPreempted, TrainingPruned,
                             TrainingStalled, TrainingStopped, TrainingTimedOut)
from pipeline.job_files import JobFiles, read_preemption, reported_user_error

STOPPED = "the training job was stopped (the task was killed, cleared or timed out)"
ENDINGS = ("succeeded", "failed", "not_started", "timeout", "stalled", "stopped", "pruned")


@dataclass(frozen=True)
class Ended:
    """How an attempt ended. ``status``: ``succeeded``, ``failed``, ``not_started`` (it never got running:
    unschedulable, an image that cannot be pulled), ``timeout``, ``stalled``, ``stopped`` or ``pruned``;
    ``message`` says how, in the place's words."""

    status: str
    message: str = ""


@dataclass(frozen=True)
class Findings:
    """What an ended attempt's ranks left in the job folder."""

    user_error: RankUserError | None = None
    preempted_step: int | None = None
    rank_failure: str | None = None  # the failing rank's traceback, from torchrun's error files

    @classmethod
    def read(cls, files: JobFiles, log_dir: Path | None = None) -> "Findings":
        preempted = read_preemption(files.progress)
        return cls(user_error=reported_user_error(files.errors),
                   preempted_step=None if preempted is None else preempted["step"],
                   rank_failure=rank_failure(log_dir) if log_dir is not None else None)


@dataclass(frozen=True)
class Decision:
    """``finish``, ``restart`` or ``fail``, with the error the attempt ended on (None on success)."""

    action: str
    error: Exception | None = None
    restart: int = 0
    max_restarts: int = 0

    @property
    def notice(self) -> str:
        """The line that announces a restart, the same on every place."""
        return (f"{str(self.error).splitlines()[0]}; restarting every rank ({self.restart + 1} of {self.max_restarts}); "
                f"training resumes from its last checkpoint")


def decide(end: Ended, findings: Findings, *, restart: int, max_restarts: int, tail: Sequence[str] = ()) -> Decision:
    """What attempt ``restart`` (0 for the first) ending as ``end`` means, with ``max_restarts`` allowed."""
    error = failure(end, findings, tail)
    if error is None:
        return Decision("finish")
    if getattr(error, "restartable", False) and restart < max_restarts:
        return Decision("restart", error, restart, max_restarts)
    return Decision("fail", error, restart, max_restarts)


def failure(end: Ended, findings: Findings, tail: Sequence[str] = ()) -> Exception | None:
    """The error an attempt's end stands for (None for success): a user error, or a ``TrainingFailed`` whose
    ``restartable`` says whether a restart may follow."""
    if end.status not in ENDINGS:
        raise ValueError(f"an attempt's end {end.status!r}: expected one of {ENDINGS}")
    last_lines = "\nlast output lines:\n" + "\n".join(tail) if tail else ""
    if end.status == "succeeded":
        return None
    if end.status == "stopped":
        return TrainingStopped(end.message or STOPPED)
    if end.status == "pruned":
        return TrainingPruned(end.message)
    if end.status == "timeout":
        return TrainingTimedOut(end.message)
    if end.status == "stalled":
        return TrainingStalled(end.message + last_lines)
    if end.status == "not_started":
        return NotStarted(end.message)
    if findings.user_error is not None:
        return findings.user_error
    if findings.preempted_step is not None:
        return TrainingPreempted(f"the ranks were sent SIGTERM (an eviction or a stop) and checkpointed at step "
                                 f"{findings.preempted_step}; {end.message}")
    failed = f"; {findings.rank_failure}" if findings.rank_failure else ""
    return TrainingFailed(end.message + failed + last_lines)


def rank_failure(log_dir: Path) -> str | None:
    """The failing rank's traceback from torchrun's error files (written by ``@record``), newest first."""
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
