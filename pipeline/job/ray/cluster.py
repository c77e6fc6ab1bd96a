"""Reaching a Ray cluster: the Jobs API client for an address (and bearer token), and a local cluster started
for one task when no address is given.

The local cluster is one head node whose every socket listens on 127.0.0.1 (``ray start --head --block``; Ray
would otherwise listen on the machine's address as well), run under ``pipeline.job.local.process_group``: it is
stopped by its process ids (SIGTERM to ``ray start``, which stops the node's processes in Ray's order without
draining the node; then the guard's SIGTERM, the grace period and SIGKILL for anything left), never by
``ray stop`` (which kills every Ray process on the machine by name), and it dies with the task process even
when that is SIGKILLed. Every port it opens is chosen free, so two tasks' clusters can share a machine.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable

from pipeline.errors import ConfigError, InfraError
from pipeline.network import free_ports

log = logging.getLogger(__name__)

START_TIMEOUT_S = 180.0
# The head's listening ports that Ray would otherwise put on fixed numbers (10001, 52365, ...).
_PORT_FLAGS = ("--port", "--dashboard-port", "--ray-client-server-port", "--dashboard-agent-listen-port",
               "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port",
               "--node-manager-port", "--object-manager-port")


def jobs_client(address: str, token: str | None = None):
    """The Ray Jobs API client of a cluster's dashboard address, with Ray's bearer token when given."""
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        return JobSubmissionClient(address, headers=headers)
    except AuthenticationError as exc:  # no retry mends a missing or wrong token
        raise ConfigError(f"the Ray cluster at {address} refused the {'token' if token else 'request without a token'}"
                          f": {str(exc).splitlines()[0]}; give the cluster's token as the password (or extra "
                          f"'token') of the Airflow connection launch.ray.connection_id") from None
    except (ConnectionError, RuntimeError) as exc:
        raise InfraError(f"the Ray cluster at {address} did not answer: {exc}") from exc


def ray_command(*args: str) -> list[str]:
    """The ``ray`` CLI of this interpreter's environment."""
    return [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())", *args]


class LocalCluster:
    """A Ray head on 127.0.0.1 that lives as long as one task (``start`` returns its Jobs API address)."""

    def __init__(self, *, cpus: int, grace_period_s: float, node_ip: str = "127.0.0.1", token: str | None = None,
                 env: dict[str, str] | None = None):
        self.cpus, self.grace_period_s, self.env = cpus or os.cpu_count() or 1, grace_period_s, dict(env or {})
        self.node_ip, self.token = node_ip, token
        if node_ip == "127.0.0.1":
            # Ray replaces a loopback node address by the machine's own and then listens on every interface;
            # as a one-machine cluster it keeps every socket on 127.0.0.1.
            self.env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        # Its jobs have ended when it is stopped: nothing to drain. With draining, ``ray start --block`` answers
        # SIGTERM by waiting up to 30 s for the node to drain, and the stop waited the whole grace period.
        self.env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
        if token:  # Ray's token authentication: every API call and every RPC must carry it
            self.env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
        self.proc: subprocess.Popen | None = None
        self.temp_dir: Path | None = None
        self.address: str | None = None  # the Jobs API (dashboard)
        self.gcs_address: str | None = None  # what another node's ``ray start --address`` joins

    def start(self, emit: Callable[[str], None], timeout_s: float = START_TIMEOUT_S) -> str:
        # Short: Ray's unix sockets live below it (a path of at most 107 bytes).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS))))
        command = ray_command("start", "--head", "--block", f"--node-ip-address={self.node_ip}", "--dashboard-host=127.0.0.1",
                              f"--num-cpus={self.cpus}", "--disable-usage-stats", "--include-dashboard=true",
                              f"--temp-dir={self.temp_dir}", *(f"{flag}={port}" for flag, port in ports.items()))
        guard = [sys.executable, "-m", "pipeline.job.local.process_group", f"--grace-period-s={self.grace_period_s}",
                 f"--parent-pid={os.getpid()}", f"--remove-after={self.temp_dir}", "--"]
        self.address = f"http://127.0.0.1:{ports['--dashboard-port']}"
        self.gcs_address = f"{self.node_ip}:{ports['--port']}"
        emit(f"starting a local Ray cluster for this task: {self.cpus} CPU(s), dashboard {self.address}")
        log_file = open(self.temp_dir / "head.log", "wb")
        self.proc = subprocess.Popen(guard + command, env={**os.environ, **self.env}, stdout=log_file,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log_file.close()
        started = time.monotonic()
        while not _answers(self.address, self.token):
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
            _end_ray_start(proc.pid, self.grace_period_s)
            stop_group(proc, self.grace_period_s)  # whatever is left, and the guard
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


def _end_ray_start(guard_pid: int, timeout_s: float) -> None:
    """SIGTERM to ``ray start`` alone (the guard's child), which stops the node's processes in Ray's order (about
    2 s here). The same signal to all of them at once leaves the raylet and the GCS waiting on each other until
    the grace period's SIGKILL: every task's local cluster took the whole grace period to stop."""
    import psutil

    try:
        children = psutil.Process(guard_pid).children()
    except psutil.Error:
        return
    for child in children:
        try:
            child.terminate()
        except psutil.Error:
            continue
    psutil.wait_procs(children, timeout=timeout_s)


def _answers(address: str, token: str | None) -> bool:
    """The head's node is registered and alive (the dashboard answers a little before its raylet does)."""
    try:
        nodes = cluster_state(address, token, "nodes")
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return any(node.get("state") == "ALIVE" for node in nodes)


def cluster_state(address: str, token: str | None, resource: str, **equal: str) -> list[dict]:
    """One of the dashboard's State API lists (``nodes``, ``actors``, ...), filtered on fields' values."""
    query = urllib.parse.urlencode([("filter_keys", k) for k in equal] + [("filter_predicates", "=")] * len(equal)
                                   + [("filter_values", v) for v in equal.values()])
    request = urllib.request.Request(f"{address}/api/v0/{resource}" + (f"?{query}" if query else ""),
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())["data"]["result"]["result"]
