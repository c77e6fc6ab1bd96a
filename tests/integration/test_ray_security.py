"""What a Ray cluster exposes and leaves: the local cluster a task starts listens on loopback only and dies with
the task, even SIGKILLed, folder and all; a cluster with Ray's token authentication is reached with the token
from the Airflow connection, never without it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.errors import ConfigError
from pipeline.job.ray.cluster import LocalCluster, jobs_client
from pipeline.job.spec import JobSpec, launch_config
from pipeline.job.supervisor import Job

pytestmark = [pytest.mark.distributed, pytest.mark.ray]

RANK = "import json, os\nif os.environ['RANK'] == '0':\n    open(os.environ['PIPELINE_RESULT_FILE'], 'w').write(json.dumps({'ok': True}))\n"


def _listening_sockets(root_pid: int) -> list[tuple[str, int, str]]:
    procs = {p.pid: p for p in psutil.Process(root_pid).children(recursive=True)}
    return [(c.laddr.ip, c.laddr.port, procs[c.pid].name()) for c in psutil.net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.pid in procs]


def test_a_local_cluster_listens_only_on_loopback():
    cluster = LocalCluster(cpus=1, grace_period_s=5)
    try:
        cluster.start(print)
        sockets = _listening_sockets(cluster.proc.pid)
    finally:
        cluster.stop()
    assert len(sockets) >= 5  # the GCS, the raylet, the dashboard and its agents: all of them checked
    assert [s for s in sockets if s[0] not in ("127.0.0.1", "::ffff:127.0.0.1")] == []


def test_a_cluster_with_token_authentication_is_reached_with_the_connections_token(tmp_path, monkeypatch):
    token = "t0ken-" + tmp_path.name
    cluster = LocalCluster(cpus=2, grace_period_s=5, token=token)
    try:
        cluster.start(print)
        port = int(cluster.address.rsplit(":", 1)[1])
        with pytest.raises(ConfigError, match=f"{cluster.address} refused the request without a token"):
            jobs_client(cluster.address).list_jobs()  # without the token: refused
        monkeypatch.setenv("AIRFLOW_CONN_RAY_SECURE", json.dumps(
            {"conn_type": "http", "host": "127.0.0.1", "port": port, "password": token}))
        (tmp_path / "rank.py").write_text(RANK)
        spec = JobSpec(entry=[str(tmp_path / "rank.py")], job_dir=tmp_path / "job", name="secure",
                       launch=launch_config({"kind": "ray", "nproc_per_node": 2, "grace_period_s": 1,
                                             "ray": {"connection_id": "ray_secure", "python": sys.executable,
                                                     "cpus_per_worker": 0.5}}))
        assert Job(spec).run(lambda line: None) == {"ok": True}
    finally:
        cluster.stop()


def test_a_sigkilled_task_leaves_nothing_of_its_local_cluster(tmp_path):
    task = ("from pipeline.job.ray.cluster import LocalCluster\n"
            "cluster = LocalCluster(cpus=1, grace_period_s=2)\ncluster.start(print)\n"
            "print('CLUSTER', cluster.proc.pid, cluster.temp_dir, flush=True)\nimport time; time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", task], stdout=subprocess.PIPE, text=True)
    try:
        line = next(line for line in proc.stdout if line.startswith("CLUSTER"))
        _, guard_pid, folder = line.split()
        processes = [psutil.Process(int(guard_pid)), *psutil.Process(int(guard_pid)).children(recursive=True)]
        assert len(processes) > 3 and Path(folder).is_dir()
    finally:
        proc.kill()
        proc.wait()
    gone, alive = psutil.wait_procs(processes, timeout=60)
    assert alive == []  # the kernel told the guard (PR_SET_PDEATHSIG), and it stopped every process by id
    deadline = time.monotonic() + 10
    while Path(folder).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(folder).exists()  # the sessions' logs and sockets folder too
