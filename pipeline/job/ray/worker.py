"""What runs inside the Ray job: each Ray Train worker runs the job's entry as a torchrun rank would, and the
failure policy that asks the supervisor's restart decision.

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
    """One Ray Train worker: the entry (``-m module``, a script, or with ``no_python`` an executable); where the
    nodes share no folder (``config["store"]``), with the job folder fetched from its copy and this rank's files
    pushed there while it runs and after (``pipeline.job.mirror``)."""
    if not config.get("store"):
        return _run_rank(config)
    from pipeline.job.mirror import JobStore, Pushing
    from pipeline.job_files import JobFiles

    store, files, rank = JobStore(config["store"]), JobFiles(Path(config["job_dir"])), int(os.environ.get("RANK", 0))
    store.fetch_inputs(files)
    with Pushing(store, files, rank, rank=rank):
        _run_rank(config)


def _run_rank(config: dict[str, Any]) -> None:
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


def failure_policy(job_dir: str, max_restarts: int, store: str | None = None):
    """Ray Train's failure policy, deciding by the supervisor's one restart decision (``pipeline.job.policy.decide``)
    on what the ranks left in the job folder: a rank's user error ends the run at once, a preempted or failed
    worker group is restarted while ``max_restarts`` allows, and each restart is announced as the supervisor
    announces its own. A worker group that could not start is Ray's own budget (``controller_failure_limit``),
    not a restart. Ray Train has no public hook for a failure policy: ``pipeline.job.ray.entry`` installs this one
    in place of the default that ``FailureConfig`` builds. ``store``: the job folder's copy, pulled first, where the
    workers' nodes share no folder with the driver's."""
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy
    from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
    from ray.train.v2.api.exceptions import ControllerError

    from pipeline.job.mirror import JobStore
    from pipeline.job.policy import Ended, Findings, decide
    from pipeline.job_files import PREEMPTED_EXIT_CODE, JobFiles

    files = JobFiles(Path(job_dir))
    # One copy for the run: what it pulled stays pulled (a preemption marker cleared below is not fetched again).
    mirror = JobStore(store) if store else None

    def refresh(now: bool = False) -> None:
        if mirror:
            mirror.pull(files, now=now)

    class SupervisorsPolicy(DefaultFailurePolicy):
        restarts = 0

        def make_decision(self, training_failed_error):
            if isinstance(training_failed_error, ControllerError):
                decision = super().make_decision(training_failed_error)
                if decision == FailureDecision.RETRY:
                    print(f"Ray Train could not start the worker group ({_first_line(training_failed_error)}); "
                          f"trying again", flush=True)
                return decision
            refresh(now=True)
            findings = Findings.read(files)
            if findings.preempted_step is None and f"exited with code {PREEMPTED_EXIT_CODE}" in str(training_failed_error):
                findings = _preemption_marked(files, findings, refresh)
            decision = decide(Ended("failed", f"a worker failed: {_first_line(training_failed_error)}"),
                              findings, restart=self.restarts, max_restarts=max_restarts)
            if decision.action != "restart":
                return FailureDecision.RAISE
            self.restarts += 1
            files.clear_preemption()  # this restart's, not the next one's
            print(decision.notice, flush=True)
            return FailureDecision.RETRY

    return SupervisorsPolicy


def _preemption_marked(files, findings, refresh, timeout_s: float = 30.0):
    """A worker exited as preempted before rank 0 wrote the marker of the step they checkpointed (Ray's controller
    sees the first worker's end at once): wait for the marker, as long as a checkpoint may take."""
    import time

    from pipeline.job.policy import Findings

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        refresh()
        found = Findings.read(files)
        if found.preempted_step is not None:
            return found
        time.sleep(0.1)
    return findings


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return " ".join(lines[:2]) if lines else type(error).__name__
