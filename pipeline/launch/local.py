"""Run ``torchrun`` as a supervised child: live per-rank output, a clean stop of every rank.

torchrun starts in its own session (process group), so that stopping it - on a timeout, an
exception, or a SIGTERM/SIGINT of the task process - signals the agent *and* every rank:
SIGTERM to the group, a grace period, then SIGKILL.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from pipeline import settings
from pipeline.errors import TrainingFailed

log = logging.getLogger(__name__)

TAIL_LINES = 60


def torchrun_command(module: str, args: Sequence[str], *, nproc_per_node: int, log_dir: Path) -> list[str]:
    """The torchrun command line: one node, ``--tee 3`` so every line carries its rank prefix."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nproc-per-node={nproc_per_node}",
        "--tee=3", f"--log-dir={log_dir}",
        "-m", module, *args,
    ]


def run_torchrun(
    module: str,
    args: Sequence[str],
    *,
    nproc_per_node: int,
    log_dir: Path,
    env: dict[str, str] | None = None,
    timeout_s: float = 24 * 3600,
    grace_period_s: float = 10.0,
    emit: Callable[[str], None] | None = None,
) -> None:
    """Run ``torchrun -m module args`` and return when it succeeds; raise ``TrainingFailed`` otherwise.

    Every output line goes to ``emit`` (the task log by default) as it arrives; on failure the
    error names the exit code and ends with the output's tail, where torchrun prints the failing
    rank's traceback.
    """
    emit = emit or log.info
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = torchrun_command(module, args, nproc_per_node=nproc_per_node, log_dir=log_dir)
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(settings.PROJECT_ROOT), child_env.get("PYTHONPATH")]))
    child_env["PYTHONUNBUFFERED"] = "1"
    emit("launching: " + " ".join(cmd))
    proc = subprocess.Popen(
        cmd, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True, text=True, errors="replace", bufsize=1,
    )
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    reader = threading.Thread(target=_pump, args=(proc, emit, tail), daemon=True)
    reader.start()
    previous = _forward_termination(proc, grace_period_s)
    try:
        returncode = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(proc, grace_period_s)
        raise TrainingFailed(f"training ran past launch.timeout_s={timeout_s}s and was stopped") from None
    finally:
        stop_group(proc, grace_period_s)
        _restore(previous)
        reader.join(timeout=5)
    if returncode != 0:
        raise TrainingFailed(
            f"torchrun exited with code {returncode}; last output lines:\n" + "\n".join(tail)
        )


def stop_group(proc: subprocess.Popen, grace_period_s: float) -> None:
    """SIGTERM the child's whole process group, wait up to the grace period, then SIGKILL it."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    if not _group_alive(pgid):
        return
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_period_s
    while time.monotonic() < deadline:
        proc.poll()
        if not _group_alive(pgid):
            return
        time.sleep(0.1)
    log.warning("process group %d still alive %.0fs after SIGTERM: sending SIGKILL", pgid, grace_period_s)
    try:
        os.killpg(pgid, signal.SIGKILL)
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


def _forward_termination(proc: subprocess.Popen, grace_period_s: float):
    """Make SIGTERM of this process stop the training group first (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        stop_group(proc, grace_period_s)
        previous_handler = previous.get(signum)
        if callable(previous_handler):
            previous_handler(signum, frame)
        else:
            raise SystemExit(128 + signum)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM,)}
    for sig in previous:
        signal.signal(sig, handler)
    return previous


def _restore(previous) -> None:
    if previous:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
