"""What the Kubernetes place's unit tests share: a job spec on the stand-in cluster (``tests/kube_standin.py``), the
fixture that starts one, the check that a job left nothing behind, and the clock of the schedule timeout."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable

import pytest

from pipeline.job.kubernetes import place as kube
from pipeline.job.spec import JobSpec, launch_config
from tests.kube_standin import StandinCluster

CONN = "k8s_standin"
# Exactly the verbs the README's Role grants.
ROLE = {("create", "jobs"), ("get", "jobs"), ("delete", "jobs"), ("create", "services"), ("delete", "services"),
        ("list", "pods"), ("get", "pods/log")}


def make_spec(tmp_path: Path, *, try_number: int = 1, **launch) -> JobSpec:
    kubernetes = {"connection_id": CONN, "volumes": [f"runs:{tmp_path}"], "schedule_timeout_s": 20,
                  **launch.pop("kubernetes", {})}
    options = {"kind": "kubernetes", "nnodes": 2, "nproc_per_node": 8, "grace_period_s": 1,
               "kubernetes": kubernetes, **launch}
    return JobSpec(entry=["-m", "pipeline.rank", "--recipe", "tabular_mlp"], job_dir=tmp_path / "job",
                   launch=launch_config(options), name=f"dag-train-{try_number}", try_number=try_number,
                   labels={"dag_id": "dag", "run_id": "manual__2026-11-30T12:00:00+00:00", "task_id": "train",
                           "try_number": str(try_number)})


@pytest.fixture
def cluster_for(monkeypatch):
    """``cluster_for(scenario, **kwargs)``: a stand-in cluster playing ``scenario`` behind the connection ``CONN``,
    and the place polling it often (the supervisor's wait between polls is the place's ``poll_s``)."""
    monkeypatch.setattr(kube, "POLL_S", 0.05)
    monkeypatch.setattr(kube.KubernetesPlace, "poll_s", 0.05)
    started = []

    def start(scenario, **kwargs) -> StandinCluster:
        cluster = StandinCluster(functools.partial(scenario, **kwargs) if kwargs else scenario).__enter__()
        for key, value in cluster.connection_env(CONN).items():
            monkeypatch.setenv(key, value)
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        cluster.__exit__()


def assert_torn_down(cluster: StandinCluster) -> None:
    assert cluster.wait_for(lambda: not cluster.left_behind(), 10), cluster.left_behind()
    jobs = [d for d in cluster.deletions if d["kind"] == "jobs"]
    assert jobs and all(d["propagationPolicy"] == "Foreground" for d in jobs)
    assert {d["name"] for d in cluster.deletions if d["kind"] == "services"} >= {d["name"] for d in jobs}
    assert set(cluster.requests) <= ROLE, set(cluster.requests) - ROLE


def schedule_clock(cluster: StandinCluster, origin: float = 0.0) -> Callable[[], float]:
    """A clock for the schedule timeout (``KubernetesPlace.clock``, ``PodsWatch.clock``): ``origin`` until the client
    has listed the pods where the scenario left them, then an hour later. So the timeout passes on the first poll
    that sees the pods' last state, whatever the machine's speed, and never before it."""
    return lambda: origin + (3600.0 if cluster.settled() else 0.0)
