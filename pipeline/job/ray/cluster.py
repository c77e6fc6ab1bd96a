"""Reaching a Ray cluster: the Jobs API client for an address (and bearer token), and a local cluster started
for one task when no address is given.

The local cluster is one head node on 127.0.0.1 (``ray start --head --block``) run under
``pipeline.job.local.guard``: it is stopped by its process ids (SIGTERM, the grace period, SIGKILL), never
by ``ray stop`` (which kills every Ray process on the machine by name), and it dies with the task process
even when that is SIGKILLed. Every port it opens is chosen free, so two tasks' clusters can share a machine.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable

from pipeline.errors import InfraError

log = logging.getLogger(__name__)

START_TIMEOUT_S = 180.0
# The head's listening ports that Ray would otherwise put on fixed numbers (10001, 52365, ...).
_PORT_FLAGS = ("--port", "--dashboard-port", "--ray-client-server-port", "--dashboard-agent-listen-port",
               "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port",
               "--node-manager-port", "--object-manager-port")


def jobs_client(address: str, token: str | None = None):
    """The Ray Jobs API client of a cluster's dashboard address, with Ray's bearer token when given."""
    from ray.job_submission import JobSubmissionClient

    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        return JobSubmissionClient(address, headers=headers)
    except (ConnectionError, RuntimeError) as exc:
        raise InfraError(f"the Ray cluster at {address} did not answer: {exc}") from exc


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ray_command(*args: str) -> list[str]:
    """The ``ray`` CLI of this interpreter's environment."""
    return [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())", *args]


class LocalCluster:
    """A Ray head on 127.0.0.1 that lives as long as one task (``start`` returns its Jobs API address)."""

    def __init__(self, *, cpus: int, grace_period_s: float, node_ip: str = "127.0.0.1",
                 env: dict[str, str] | None = None):
        self.cpus, self.grace_period_s, self.env = cpus or os.cpu_count() or 1, grace_period_s, dict(env or {})
        self.node_ip = node_ip
        self.proc: subprocess.Popen | None = None
        self.temp_dir: Path | None = None
        self.address: str | None = None  # the Jobs API (dashboard)
        self.gcs_address: str | None = None  # what another node's ``ray start --address`` joins

    def start(self, emit: Callable[[str], None], timeout_s: float = START_TIMEOUT_S) -> str:
        # Short: Ray's unix sockets live below it (a path of at most 107 bytes).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        ports = {flag: free_port() for flag in _PORT_FLAGS}
        command = ray_command("start", "--head", "--block", f"--node-ip-address={self.node_ip}", "--dashboard-host=127.0.0.1",
                              f"--num-cpus={self.cpus}", "--disable-usage-stats", "--include-dashboard=true",
                              f"--temp-dir={self.temp_dir}", *(f"{flag}={port}" for flag, port in ports.items()))
        guard = [sys.executable, "-m", "pipeline.job.local.guard", f"--grace-period-s={self.grace_period_s}",
                 f"--parent-pid={os.getpid()}", "--"]
        self.address = f"http://127.0.0.1:{ports['--dashboard-port']}"
        self.gcs_address = f"{self.node_ip}:{ports['--port']}"
        emit(f"starting a local Ray cluster for this task: {self.cpus} CPU(s), dashboard {self.address}")
        log_file = open(self.temp_dir / "head.log", "wb")
        self.proc = subprocess.Popen(guard + command, env={**os.environ, **self.env}, stdout=log_file,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log_file.close()
        started = time.monotonic()
        while not _answers(self.address):
            if self.proc.poll() is not None or time.monotonic() - started > timeout_s:
                tail = self.head_log()[-3000:]
                self.stop()
                raise InfraError(f"the local Ray cluster did not start within {timeout_s:g}s; its log ends:\n{tail}")
            time.sleep(0.5)
        emit(f"local Ray cluster up after {time.monotonic() - started:.1f}s")
        return self.address

    def head_log(self) -> str:
        path = self.temp_dir / "head.log" if self.temp_dir else None
        return path.read_text(errors="replace") if path and path.exists() else ""

    def stop(self) -> None:
        """Every process of the cluster stopped by id, its temporary folder removed; any number of times."""
        from pipeline.job.local.place import stop_group

        proc, self.proc = self.proc, None
        if proc is not None:
            stop_group(proc, self.grace_period_s)
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


def _answers(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"{address}/api/version", timeout=2) as response:
            return "ray_version" in json.loads(response.read())
    except (OSError, ValueError):
        return False
