"""Ray clusters for the tests, started and stopped by process id (never ``ray stop``, which kills every Ray
process on the machine by name): a head from the product's ``LocalCluster``, and worker nodes that join it,
each under ``pipeline.job.local.process_group`` so that nothing outlives the test process."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.job.local.place import stop_group
from pipeline.job.ray.cluster import ray_command
from pipeline.network import free_ports

TRAIN_ACTORS = {"RayTrainWorker", "TrainController"}
_WORKER_PORT_FLAGS = ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port",
                      "--runtime-env-agent-port")


class WorkerNode:
    """``ray start --address HEAD --block`` of one more node, optionally inside a network namespace (``wrap``), its
    session under ``temp_dir`` (default: a new folder; removed by ``stop``)."""

    def __init__(self, gcs_address: str, *, node_ip: str, cpus: int, wrap: list[str] = (), env: dict | None = None,
                 temp_dir: Path | None = None):
        # Short, under /tmp: the session's socket paths must stay within the 107 bytes a Unix socket's path may take.
        self.temp_dir = temp_dir or Path(tempfile.mkdtemp(prefix="raywk-", dir="/tmp"))
        command = ray_command("start", f"--address={gcs_address}", "--block", f"--node-ip-address={node_ip}",
                              f"--num-cpus={cpus}", "--disable-usage-stats", f"--temp-dir={self.temp_dir}",
                              *(f"{flag}={port}" for flag, port in zip(_WORKER_PORT_FLAGS, free_ports(len(_WORKER_PORT_FLAGS)))))
        guard = [sys.executable, "-m", "pipeline.job.local.process_group", "--grace-period-s=5", f"--parent-pid={os.getpid()}", "--"]
        self.log = open(self.temp_dir / "node.log", "wb")
        self.proc = subprocess.Popen([*wrap, *guard, *command], env={**os.environ, **(env or {})}, stdout=self.log,
                                     stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """Stop the node's every process by id (any number of times): a machine going away."""
        stop_group(self.proc, 5)
        self.log.close()
        import shutil

        shutil.rmtree(self.temp_dir, ignore_errors=True)


def alive_nodes(address: str) -> int:
    from ray.util.state import list_nodes

    return sum(1 for node in list_nodes(address=address) if node.state == "ALIVE")


def wait_for_nodes(address: str, count: int, timeout_s: float = 300) -> None:
    """Until ``count`` nodes are alive. A worker node joining from its network namespace took over 120 s once, in a
    full ``make test`` whose other lane ran a sweep's deployment beside it (it joins in seconds on an idle machine)."""
    deadline = time.monotonic() + timeout_s
    while alive_nodes(address) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"the Ray cluster at {address} has {alive_nodes(address)} of {count} nodes")
        time.sleep(1)


def train_actors_left(address: str, timeout_s: float = 30) -> list[str]:
    """Ray Train's actors still alive after a job ended (the controller and workers), waited for."""
    from ray.util.state import list_actors

    deadline = time.monotonic() + timeout_s
    while True:
        alive = [f"{a.class_name} pid={a.pid}" for a in list_actors(address=address, filters=[("state", "=", "ALIVE")])
                 if a.class_name in TRAIN_ACTORS]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def ray_processes() -> list[str]:
    """Ray's processes on this machine (raylet, GCS, dashboard, its workers), by command line."""
    import psutil

    names = ("raylet", "gcs_server", "ray::", "ray/dashboard", "ray/_private", "ray.scripts.scripts")
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if any(name in line for name in names):
            found.append(f"{proc.info['pid']}: {line[:120]}")
    return found
