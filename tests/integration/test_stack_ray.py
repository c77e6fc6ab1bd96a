"""``make stack RAY=1``'s Ray head (pipeline/dev/stack/ray_head.py) for real: started as the stack starts it, reached
through the ``ray_default`` connection the stack gives Airflow (token required), running a job with the ``python``
of its PATH as a cluster that the task did not start does, and gone after ``make stack-down``'s stop by process id."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from pipeline.dev.stack import ray_head
from pipeline.dev.stack.processes import stop_processes
from pipeline.errors import ConfigError
from pipeline.job.ray.cluster import jobs_client
from pipeline.job.spec import JobSpec, launch_config
from pipeline.job.supervisor import Job

pytestmark = [pytest.mark.distributed, pytest.mark.ray]

RANK = ("import json, os, sys\nif os.environ['RANK'] == '0':\n"
        "    open(os.environ['PIPELINE_RESULT_FILE'], 'w').write(json.dumps({'python': sys.executable}))\n")


def test_the_stacks_ray_head_serves_the_ray_default_connection_and_stops_by_process_id(tmp_path, monkeypatch):
    token = "stack-token-" + tmp_path.name
    address_file = tmp_path / "ray.json"
    env = {k: v for k, v in os.environ.items() if k != "PATH"}
    env["PATH"] = "/usr/bin:/bin"  # the head's `python` must still be this environment's
    with open(tmp_path / "ray-head.log", "ab") as log:
        proc = subprocess.Popen(ray_head.command(address_file), env={**env, "RAY_AUTH_TOKEN": token}, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    tree: list[psutil.Process] = []
    try:
        address = ray_head.wait_address(address_file, lambda: proc.poll() is not None, 240)
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert address.startswith("http://127.0.0.1:")
        with pytest.raises(ConfigError, match="refused the request without a token"):
            jobs_client(address).list_jobs()

        monkeypatch.setenv("AIRFLOW_CONN_RAY_DEFAULT", ray_head.connection(address, token))
        (tmp_path / "rank.py").write_text(RANK)
        spec = JobSpec(entry=[str(tmp_path / "rank.py")], job_dir=tmp_path / "job", name="stack-ray",
                       launch=launch_config({"kind": "ray", "nproc_per_node": 1, "grace_period_s": 1,
                                             "ray": {"cpus_per_worker": 0.5}}))
        result = Job(spec).run(lambda line: None)
        assert os.path.realpath(result["python"]) == os.path.realpath(sys.executable)
    finally:
        stop_processes([proc.pid], 15)  # what make stack-down does with every service's pid
    assert proc.wait(5) is not None
    assert [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    assert len(tree) >= 3 and not address_file.exists()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{address}/api/version", timeout=1)
        except OSError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"{address} still answers after the stop")
