"""The local place (``launch.kind = local``): each attempt is ``torchrun`` as a child of this process, its
output read live, under the supervisor's policy (``pipeline.job.supervisor``).

The attempt runs under ``pipeline.job.local.process_group`` in a session (process group) of its own, so stopping
it signals the agent *and* every rank: SIGTERM, the grace period, then SIGKILL. If the task process
dies without a chance to clean up (SIGKILL), the guard stops the attempt itself.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from pipeline import deployment
from pipeline.errors import ConfigError
from pipeline.job.places import Clusters
from pipeline.job.policy import Ended
from pipeline.job.spec import Attempt, JobSpec
from pipeline.job_files import DUMP_SIGNAL
from pipeline.process_table import alive, descendants

log = logging.getLogger(__name__)



def torchrun_command(
    entry: Sequence[str],
    *,
    nproc_per_node: int,
    log_dir: Path,
    nnodes: int = 1,
    min_nnodes: int = 0,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "job",
    no_python: bool = False,
    python: str = sys.executable,
) -> list[str]:
    """The torchrun command line (torch's, ended without the interpreter's teardown:
    ``pipeline.job.local.torchrun``); ``--tee 3`` so every line carries its rank prefix.

    ``entry`` is ``["-m", "package.module", *args]``, ``["script.py", *args]``, or with
    ``no_python`` an executable and its arguments (a CLI that reads the torchrun environment). ``python``
    runs the agent: this interpreter, or a toolchain's (``pipeline.toolchains``).
    """
    if nnodes == 1 and rdzv_endpoint is None:
        topology = ["--standalone", "--nnodes=1"]
    else:
        if not rdzv_endpoint:
            raise ValueError(f"nnodes={nnodes} needs rdzv_endpoint (host:port of the c10d rendezvous)")
        elastic = f"{min_nnodes}:" if 0 < min_nnodes < nnodes else ""  # torchrun's elastic MIN:MAX
        topology = [f"--nnodes={elastic}{nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
    return [
        python, "-m", "pipeline.job.local.torchrun", *topology,
        f"--nproc-per-node={nproc_per_node}",
        "--tee=3", f"--log-dir={log_dir}", *(["--no-python"] if no_python else []),
        *entry,
    ]


class LocalPlace:
    """``launch.kind = local``: this node's share of each attempt as torchrun under the guard.

    A failed attempt is replaced by a fresh torchrun (a new agent and rendezvous) rather than by
    torchrun's own ``--max-restarts``: with torch 2.14 and gloo, ranks restarted inside one agent hung
    in ``init_process_group`` in two of three tries.
    """

    poll_s = 0.5

    def __init__(self, spec: JobSpec, clusters: Clusters | None = None):
        if spec.launch.gpus_per_node:
            import torch

            found = torch.cuda.device_count()
            if found < spec.launch.gpus_per_node:
                raise ConfigError(f"launch.gpus_per_node={spec.launch.gpus_per_node}: this node has {found} GPU(s)")
        self.spec = spec
        self.proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def start(self, attempt: Attempt, emit: Callable[[str], None]) -> None:
        spec, launch = self.spec, self.spec.launch
        command = torchrun_command(
            spec.entry, nproc_per_node=launch.nproc_per_node, nnodes=launch.nnodes, min_nnodes=launch.min_nnodes,
            node_rank=launch.node_rank, rdzv_endpoint=launch.rdzv_endpoint or None, no_python=spec.no_python,
            log_dir=attempt.log_dir, rdzv_id=attempt.name, python=spec.python or sys.executable,
        )
        env = {**os.environ, **attempt.env(), "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(deployment.PROJECT_ROOT), env.get("PYTHONPATH")]))
        emit("launching: " + " ".join(command))
        guard = [sys.executable, "-m", "pipeline.job.local.process_group", f"--grace-period-s={launch.grace_period_s}",
                 f"--parent-pid={os.getpid()}", "--"]
        self.proc = subprocess.Popen(
            guard + command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, text=True, errors="replace", bufsize=1,
        )
        self._reader = threading.Thread(target=_pump, args=(self.proc, emit), daemon=True)
        self._reader.start()

    def poll(self) -> Ended | None:
        assert self.proc is not None
        returncode = self.proc.poll()
        if returncode is None:
            return None
        if self._reader is not None:
            self._reader.join(timeout=5)  # the last lines before the verdict
        if returncode == 0:
            return Ended("succeeded")
        return Ended("failed", f"torchrun exited with code {returncode}")

    def stop(self, grace_period_s: float) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace_period_s)
            if self._reader is not None:
                self._reader.join(timeout=5)

    def dump_stacks(self, beats: dict, emit: Callable[[str], None]) -> None:
        dump_local_stacks(beats)


def dump_local_stacks(beats: dict) -> None:
    """Every rank of this machine prints its Python stacks (faulthandler, on ``DUMP_SIGNAL``) before the job
    is stopped; ``beats``: the ranks' heartbeats, which name their process ids."""
    for beat in beats.values():
        try:
            os.kill(beat["pid"], DUMP_SIGNAL)
        except ProcessLookupError:
            pass
    time.sleep(2)


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


def _pump(proc: subprocess.Popen, emit: Callable[[str], None]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        emit(line.rstrip("\n"))
