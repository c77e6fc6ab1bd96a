"""The local launcher (``launch.kind = local``): ``torchrun`` as a supervised child of this process, with
live per-rank output, a stall watchdog, restarts and a clean stop of every rank.

The job runs under ``pipeline.launch.guard`` in a session (process group) of its own, so stopping
it - on a timeout, a stall, an exception, ``on_kill``, or a SIGTERM/SIGINT of the task process -
signals the agent *and* every rank: SIGTERM to the group, a grace period, then SIGKILL. If the
task process dies without a chance to clean up (SIGKILL), the guard stops the group itself.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from pipeline import settings
from pipeline.errors import ConfigError, TrainingFailed, TrainingStalled, reported_user_error
from pipeline.data.shm import clean_stale_shared_memory
from pipeline.processes import alive, descendants
from pipeline.launch.spec import JobSpec, launch_config
from pipeline.train.progress import DUMP_SIGNAL, read_heartbeats

log = logging.getLogger(__name__)

TAIL_LINES = 60
POLL_S = 0.5


def torchrun_command(
    entry: Sequence[str],
    *,
    nproc_per_node: int,
    log_dir: Path,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "job",
    no_python: bool = False,
) -> list[str]:
    """The torchrun command line; ``--tee 3`` so every line carries its rank prefix.

    ``entry`` is ``["-m", "package.module", *args]``, ``["script.py", *args]``, or with
    ``no_python`` an executable and its arguments (a CLI that reads the torchrun environment).
    """
    if nnodes == 1 and rdzv_endpoint is None:
        topology = ["--standalone", "--nnodes=1"]
    else:
        if not rdzv_endpoint:
            raise ValueError(f"nnodes={nnodes} needs rdzv_endpoint (host:port of the c10d rendezvous)")
        topology = [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
    return [
        sys.executable, "-m", "torch.distributed.run", *topology,
        f"--nproc-per-node={nproc_per_node}",
        "--tee=3", f"--log-dir={log_dir}", *(["--no-python"] if no_python else []),
        *entry,
    ]


class TorchrunJob:
    """One supervised torchrun job on this node. ``run()`` blocks; ``stop()`` may come from anywhere.

    ``max_restarts``: when the job fails, every rank is stopped and torchrun is launched again, up to
    that many times; a training entrypoint that checkpoints resumes where it stopped. The supervisor
    relaunches torchrun itself (a fresh agent and rendezvous) rather than using torchrun's own
    ``--max-restarts``: with torch 2.14 and gloo, ranks restarted inside one agent hung in
    ``init_process_group`` in two of three tries.
    """

    def __init__(self, spec: JobSpec):
        launch = spec.launch
        if launch.nnodes > 1 and not launch.rdzv_endpoint:
            raise ConfigError(f"launch.nnodes={launch.nnodes} with the local launcher needs launch.rdzv_endpoint "
                              f"(HOST:PORT of the c10d rendezvous that every node's launcher joins)")
        if launch.gpus_per_node:
            import torch

            found = torch.cuda.device_count()
            if found < launch.gpus_per_node:
                raise ConfigError(f"launch.gpus_per_node={launch.gpus_per_node}: this node has {found} GPU(s)")
        self.spec = spec
        self.files = spec.files
        self.log_dir = self.files.logs(spec.try_number)
        self.progress_dir = self.files.progress
        self._command_args = dict(
            entry=list(spec.entry), nproc_per_node=launch.nproc_per_node, nnodes=launch.nnodes,
            node_rank=launch.node_rank, rdzv_endpoint=launch.rdzv_endpoint or None, no_python=spec.no_python,
        )
        self.max_restarts = launch.max_restarts
        self.env = {**spec.env, **self.files.env(), "PIPELINE_TRY_NUMBER": str(spec.try_number),
                    "PIPELINE_BACKEND": launch.backend}  # what @task.torchrun's process group uses
        self.timeout_s = launch.timeout_s
        self.grace_period_s = launch.grace_period_s
        self.stall_timeout_s = launch.stall_timeout_s or None
        self.proc: subprocess.Popen | None = None
        self._stopped_by: str | None = None

    def run(self, emit: Callable[[str], None] | None = None) -> None:
        """Run to completion; raise ``TrainingFailed`` (or ``TrainingStalled``) otherwise.

        Every output line goes to ``emit`` (the task log by default) as it arrives; on failure the
        error names the exit code, the failing rank's traceback and the output's tail.
        """
        emit = emit or log.info
        for restart in range(self.max_restarts + 1):
            try:
                return self._launch(emit, restart)
            except TrainingStalled:
                raise  # a hang is the machine's or the network's: the task retry decides
            except TrainingFailed as exc:
                if restart == self.max_restarts or self._stopped_by:
                    raise
                emit(f"{str(exc).splitlines()[0]}; restarting every rank ({restart + 1} of "
                     f"{self.max_restarts}); training resumes from its last checkpoint")

    def _launch(self, emit: Callable[[str], None], restart: int) -> None:
        clean_stale_shared_memory()  # logs what it removed, once
        for folder in (self.progress_dir, self.files.errors):
            shutil.rmtree(folder, ignore_errors=True)  # a previous attempt's heartbeats and errors are not this one's
        self.progress_dir.mkdir(parents=True)
        torchrun_logs = self.log_dir / f"torchrun-{restart}"
        command = torchrun_command(**self._command_args, log_dir=torchrun_logs,
                                   rdzv_id=f"{self.spec.name}-{restart}")
        child_env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1", "PIPELINE_RESTART_COUNT": str(restart)}
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(settings.PROJECT_ROOT), child_env.get("PYTHONPATH")]))
        emit("launching: " + " ".join(command))
        guard = [sys.executable, "-m", "pipeline.launch.guard", f"--grace-period-s={self.grace_period_s}",
                 f"--parent-pid={os.getpid()}", "--"]
        self.proc = subprocess.Popen(
            guard + command, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, text=True, errors="replace", bufsize=1,
        )
        tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        reader = threading.Thread(target=_pump, args=(self.proc, emit, tail), daemon=True)
        reader.start()
        previous = self._forward_termination()
        try:
            returncode = self._wait(emit)
        finally:
            stop_group(self.proc, self.grace_period_s)  # whatever ended the wait, no rank outlives it
            _restore(previous)
            reader.join(timeout=5)
        if self._stopped_by == "stall":
            raise TrainingStalled(self._stall_message + "\nlast output lines:\n" + "\n".join(tail))
        if self._stopped_by == "request":
            raise TrainingFailed("the training job was stopped (the task was killed, cleared or timed out)")
        if self._stopped_by == "timeout":
            raise TrainingFailed(f"training ran past launch.timeout_s={self.timeout_s}s and was stopped")
        if returncode != 0:
            user_error = reported_user_error(self.files.errors)
            if user_error is not None:
                raise user_error  # bad config or data: a restart or a retry would fail the same way
            failure = rank_failure(torchrun_logs)
            raise TrainingFailed(
                f"torchrun exited with code {returncode}"
                + (f"; {failure}" if failure else "")
                + "\nlast output lines:\n" + "\n".join(tail)
            )

    def stop(self) -> None:
        """Stop the job for good (``on_kill``, a signal): SIGTERM its whole process group, wait up to the
        grace period, then SIGKILL it. No restart follows."""
        self._stopped_by = self._stopped_by or "request"
        if self.proc is not None:
            stop_group(self.proc, self.grace_period_s)

    def _wait(self, emit: Callable[[str], None]) -> int:
        assert self.proc is not None
        started = last_change = time.monotonic()
        last_beats: dict = {}  # the clock starts with the first heartbeat: imports and set-up are not steps
        while True:
            try:
                return self.proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if now - started > self.timeout_s:
                self._stopped_by = "timeout"
                stop_group(self.proc, self.grace_period_s)
                return self.proc.wait()
            beats = read_heartbeats(self.progress_dir)
            progress = {rank: {k: v for k, v in beat.items() if k != "time"} for rank, beat in beats.items()}
            if progress != last_beats:
                last_beats, last_change = progress, now
            elif progress and self.stall_timeout_s and now - last_change > self.stall_timeout_s:
                self._stall_message = _describe_stall(beats, now - last_change, self.stall_timeout_s)
                emit(self._stall_message)
                self._dump_stacks(beats, emit)
                self._stopped_by = "stall"
                stop_group(self.proc, self.grace_period_s)
                return self.proc.wait()

    def _dump_stacks(self, beats: dict, emit: Callable[[str], None]) -> None:
        """Ask every rank to print its Python stacks (faulthandler) before the job is stopped."""
        emit("asking every rank for its stack traces (they follow, with rank prefixes)")
        for beat in beats.values():
            try:
                os.kill(beat["pid"], DUMP_SIGNAL)
            except ProcessLookupError:
                pass
        time.sleep(2)

    def _forward_termination(self):
        """Make SIGTERM/SIGINT of this process stop the training group first (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def handler(signum, frame):
            self.stop()
            previous_handler = previous.get(signum)
            if callable(previous_handler):
                previous_handler(signum, frame)
            else:
                raise SystemExit(128 + signum)

        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        for sig in previous:
            signal.signal(sig, handler)
        return previous


class LocalLauncher:
    """``launch.kind = local``: this node's share of the job as a supervised torchrun (see ``TorchrunJob``)."""

    def __init__(self):
        self._job: TorchrunJob | None = None
        self._stopped = False

    def run(self, spec: JobSpec, emit: Callable[[str], None]) -> None:
        self._job = TorchrunJob(spec)
        if self._stopped:
            raise TrainingFailed("the training job was stopped before it started")
        self._job.run(emit)

    def stop(self) -> None:
        self._stopped = True
        if self._job is not None:
            self._job.stop()


def run_torchrun(entry: Sequence[str], *, job_dir: Path, emit: Callable[[str], None] | None = None,
                 env: dict[str, str] | None = None, no_python: bool = False, **launch) -> dict | None:
    """Run one supervised local torchrun job to completion; ``launch``: ``launch.*`` fields
    (nproc_per_node, max_restarts, stall_timeout_s, ...). Returns rank 0's result, if it wrote one."""
    from pipeline.launch.spec import Job

    spec = JobSpec(entry=list(entry), job_dir=Path(job_dir), launch=launch_config({"kind": "local", **launch}),
                   env=dict(env or {}), no_python=no_python)
    return Job(spec).run(emit)


def _describe_stall(beats: dict, idle_s: float, stall_timeout_s: float) -> str:
    where = "; ".join(
        f"rank {rank}: step {beat['step']}" + (f"/{beat['total']}" if beat.get("total") else "")
        + (f" epoch {beat['epoch']}" if beat.get("epoch") is not None else "") + f" ({beat['phase']}, pid {beat['pid']})"
        for rank, beat in sorted(beats.items())
    )
    return (f"training stalled: no step completed for {idle_s:.0f}s (launch.stall_timeout_s={stall_timeout_s:g}); "
            f"last reported positions: {where}")


def rank_failure(torchrun_log_dir: Path) -> str | None:
    """The failing rank's traceback from torchrun's error files (written by ``@record``), newest first."""
    files = sorted(Path(torchrun_log_dir).glob("**/error.json"), key=lambda p: p.stat().st_mtime, reverse=True)
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
        return f"local rank {local_rank} failed ({attempt.replace('_', ' ')}):\n{stack.rstrip()}"
    return None


def stop_group(proc: subprocess.Popen, grace_period_s: float) -> None:
    """Stop the guard and so the whole job: SIGTERM, then wait while the guard stops every descendant
    (SIGTERM, the grace period, SIGKILL); SIGKILL whatever is left if the guard cannot finish."""
    if proc.poll() is not None and not _group_alive(proc.pid):
        return
    tree = descendants(proc.pid)  # remembered: they lose this parent if the guard dies first
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_period_s + 5
    while time.monotonic() < deadline and (proc.poll() is None or _group_alive(proc.pid)):
        time.sleep(0.1)
    survivors = [pid for pid in [proc.pid, *tree, *descendants(proc.pid)] if alive(pid)]
    if survivors:
        log.warning("%d process(es) of the job still alive after the grace period: sending SIGKILL", len(survivors))
        for pid in survivors:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.poll()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pump(proc: subprocess.Popen, emit: Callable[[str], None], tail: collections.deque) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        tail.append(line)
        emit(line)


def _restore(previous) -> None:
    if previous:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
