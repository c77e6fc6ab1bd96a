"""What runs inside the Ray job: each Ray Train worker runs the job's entry as a torchrun rank would, and the
failure policy that keeps a user error from being retried.

Ray Train has set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR/PORT`` and
initialised the process group before ``run_rank`` is called (``pipeline.train.distributed.setup`` joins it
rather than initialising a second one); the job folder's variables come with the job's ``runtime_env``.
Every line a worker prints carries ``[rank N]:``, as torchrun's ``--tee`` gives the local place.
"""

from __future__ import annotations

import io
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any


class RankPrefixed(io.TextIOBase):
    """A text stream that starts every line with the rank's prefix."""

    def __init__(self, stream, prefix: str):
        self.stream, self.prefix, self._line_start = stream, prefix, True

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            if self._line_start:
                out.append(self.prefix)
            out.append(piece)
            self._line_start = piece.endswith("\n")
        self.stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return False


def run_rank(config: dict[str, Any]) -> None:
    """One Ray Train worker: the entry (``-m module``, a script, or with ``no_python`` an executable)."""
    entry, rank = list(config["entry"]), os.environ.get("RANK", "?")
    os.environ["PIPELINE_RESTART_COUNT"] = str(_restarts(config))
    prefix = f"[rank {rank}]: "
    if config.get("no_python"):  # an executable (a toolchain's CLI) reading the same environment, its lines live
        with subprocess.Popen(entry, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace") as proc:
            for line in proc.stdout:
                print(prefix + line.rstrip("\n"), flush=True)
        if proc.returncode:
            raise RuntimeError(f"rank {rank}: {entry[0]} exited with code {proc.returncode}")
        return
    stdout, stderr, argv = sys.stdout, sys.stderr, sys.argv
    sys.stdout, sys.stderr = RankPrefixed(stdout, prefix), RankPrefixed(stderr, prefix)
    try:
        if entry[0] == "-m":
            sys.argv = [entry[1], *entry[2:]]
            runpy.run_module(entry[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = entry
            runpy.run_path(entry[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise RuntimeError(f"rank {rank} exited with code {exc.code}") from None
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr, sys.argv = stdout, stderr, argv


def _restarts(config: dict[str, Any]) -> int:
    """How many times Ray has restarted this attempt's workers (Ray Train keeps no count the workers can read):
    every start of the worker group has its own rendezvous address, marked by each rank before it counts."""
    marks = Path(config["job_dir"]) / "progress" / "ray-worker-groups"
    marks.mkdir(parents=True, exist_ok=True)
    (marks / f"{os.environ.get('MASTER_ADDR')}_{os.environ.get('MASTER_PORT')}").touch()
    return max(0, len(list(marks.iterdir())) - 1)


def failure_policy(job_dir: str, max_restarts: int):
    """Ray Train's default failure policy, in the supervisor's terms: a rank's user error (reported to the job
    folder's errors) ends the run at once (a bad config or bad data fails the same way on every restart),
    and every restart is announced as the supervisor announces its own, with why (a preemption's step)."""
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy
    from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
    from ray.train.v2.api.exceptions import ControllerError

    class SupervisorsPolicy(DefaultFailurePolicy):
        restarts = 0

        def make_decision(self, training_failed_error):
            from pipeline.errors import reported_user_error
            from pipeline.job.spec import JobFiles
            from pipeline.train.progress import PREEMPTION_FILE, read_preemption

            files = JobFiles(Path(job_dir))
            if reported_user_error(files.errors) is not None:
                return FailureDecision.RAISE
            decision = super().make_decision(training_failed_error)
            if decision == FailureDecision.RETRY and isinstance(training_failed_error, ControllerError):
                print(f"Ray Train could not start the worker group ({_first_line(training_failed_error)}); "
                      f"trying again", flush=True)  # its own budget (controller_failure_limit), not a restart
            elif decision == FailureDecision.RETRY:
                self.restarts += 1
                preempted = read_preemption(files.progress)
                why = (f"the ranks were sent SIGTERM (an eviction or a stop) and checkpointed at step {preempted['step']}"
                       if preempted else f"a worker failed: {_first_line(training_failed_error)}")
                (files.progress / PREEMPTION_FILE).unlink(missing_ok=True)  # this restart's, not the next one's
                print(f"{why}; restarting every rank ({self.restarts} of {max_restarts}); training resumes from "
                      f"its last checkpoint", flush=True)
            return decision

    return SupervisorsPolicy


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return " ".join(lines[:2]) if lines else type(error).__name__
