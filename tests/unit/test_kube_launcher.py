"""What only the Kubernetes place does on a worker, against a stand-in API server (tests/kube_standin.py): no
Kubernetes API server can run on the project's machines. The place is the real one, with the official
client reaching the server through the Kubernetes provider's connection; the stand-in plays the
scheduler, the Job controller and the kubelet (tests/kube_scenarios.py). The deferred form is in
test_kube_deferred.py; what every place guarantees is in test_place_contract.py."""

from __future__ import annotations

import functools

import pytest

from pipeline.airflow.connections import AirflowClusters
from pipeline.errors import NotStarted as PodsNotRunning
from pipeline.errors import RankUserError, TrainingFailed
from pipeline.job.kubernetes import place as kube
from pipeline.job.spec import Attempt, JobSpec
from pipeline.job.supervisor import Job as _Job
from tests import kube_scenarios
from tests.kube_launch import CONN, assert_torn_down, cluster_for, make_spec, schedule_clock  # noqa: F401 - a fixture


def Job(spec: JobSpec) -> _Job:  # noqa: N802 - the supervisor's Job, reaching the stand-in through the connection
    return _Job(spec, clusters=AirflowClusters())


def test_a_job_runs_streams_every_pods_log_live_and_returns_rank_0s_result(cluster_for, tmp_path):
    cluster = cluster_for(kube_scenarios.nodes_run, lines=4)
    lines: list[str] = []
    result = Job(make_spec(tmp_path)).run(lines.append)
    assert result == {"final_loss": 0.25, "nodes": 2, "restart": 0}  # written by "rank 0" into the shared job folder
    for node in (0, 1):
        assert [line for line in lines if line.startswith(f"[node {node}] ")] == [
            f"[node {node}] [rank {node}] step {i}" for i in range(4)]
    assert cluster.max_open_streams == 2  # both pods' logs were followed at the same time
    created = cluster.created_jobs[0]["metadata"]
    assert created["labels"]["pipeline.ddp/run_id"] == "manual__2026-11-30T12_00_00_00_00"
    assert created["annotations"]["pipeline.ddp/run_id"] == "manual__2026-11-30T12:00:00+00:00"
    assert any(line.startswith("all 2 pod(s)") for line in lines)
    assert_torn_down(cluster)


def test_unschedulable_pods_fail_the_attempt_with_the_schedulers_message(cluster_for, tmp_path, monkeypatch):
    cluster = cluster_for(kube_scenarios.unschedulable)
    monkeypatch.setattr(kube.KubernetesPlace, "clock", staticmethod(schedule_clock(cluster)))
    with pytest.raises(PodsNotRunning) as err:
        Job(make_spec(tmp_path, kubernetes={"schedule_timeout_s": 1.5})).run(lambda line: None)
    message = str(err.value)
    assert "schedule_timeout_s=1.5s" in message
    assert "node 1" in message and "unschedulable: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu." in message
    assert_torn_down(cluster)


def test_an_image_pull_failure_is_named_when_the_schedule_timeout_passes(cluster_for, tmp_path, monkeypatch):
    cluster = cluster_for(kube_scenarios.image_pull_backoff)
    monkeypatch.setattr(kube.KubernetesPlace, "clock", staticmethod(schedule_clock(cluster)))
    with pytest.raises(PodsNotRunning, match=r'node 1 \(.*\): image pull failure \(ImagePullBackOff\): '
                                             r'Back-off pulling image "registry.example/ddp:missing"'):
        Job(make_spec(tmp_path, kubernetes={"schedule_timeout_s": 1.5, "image": "registry.example/ddp:missing"})).run(print)
    assert_torn_down(cluster)


def test_a_pod_that_crashes_before_the_others_run_fails_at_once(cluster_for, tmp_path, monkeypatch):
    cluster = cluster_for(kube_scenarios.crash_before_start)
    # Once the place has seen the crash, the schedule timeout has passed too: a place that waited for the timeout
    # instead of failing at the crash would report the timeout.
    monkeypatch.setattr(kube.KubernetesPlace, "clock", staticmethod(schedule_clock(cluster)))
    with pytest.raises(PodsNotRunning, match=r"node 1 .* crashed before every pod was running: exited with code 127"):
        Job(make_spec(tmp_path, kubernetes={"schedule_timeout_s": 600})).run(print)
    assert_torn_down(cluster)


def test_a_failed_pod_stops_the_job_and_max_restarts_replaces_it_then_the_attempt_fails(cluster_for, tmp_path):
    cluster = cluster_for(kube_scenarios.nodes_run, fail_node=1)
    lines: list[str] = []
    with pytest.raises(TrainingFailed) as err:
        Job(make_spec(tmp_path, max_restarts=1)).run(lines.append)
    assert not isinstance(err.value, RankUserError)
    assert "node 1 (pod " in str(err.value) and "exited with code 1" in str(err.value)
    names = [j["metadata"]["name"] for j in cluster.created_jobs]
    assert len(names) == 2 and names[0].endswith("-r0") and names[1].endswith("-r1")
    assert any("restarting every rank (1 of 1)" in line for line in lines)
    assert "[node 1] RuntimeError: boom" in lines  # the failing pod's last lines reached the task log
    assert_torn_down(cluster)


def test_a_pod_removed_after_it_succeeded_does_not_fail_the_task(cluster_for, tmp_path):
    """The autoscaler may delete a finished pod before its log is read: the Job's own status decides."""
    cluster = cluster_for(kube_scenarios.nodes_run, lines=3, autoscaled_away=True)
    lines: list[str] = []
    assert Job(make_spec(tmp_path)).run(lines.append)["nodes"] == 2
    assert any(line.startswith("[node 1] (log stream of") and "(404)" in line for line in lines), lines
    assert "[node 0] [rank 0] step 2" in lines
    assert_torn_down(cluster)


def test_a_job_left_by_a_dead_worker_of_the_same_attempt_is_replaced(cluster_for, tmp_path):
    from kubernetes import client as k8s

    from pipeline.job.kubernetes.place import Cluster, manifests_for  # noqa: F401

    cluster = cluster_for(kube_scenarios.nodes_run)
    spec = make_spec(tmp_path)
    leftover = manifests_for(Attempt(spec, 0))
    Cluster(AirflowClusters().kubernetes_client(CONN)).create(leftover)  # its pods run: the scenario plays them
    assert Job(spec).run(lambda line: None)["nodes"] == 2
    assert [j["metadata"]["name"] for j in cluster.created_jobs] == [leftover.name] * 2
    assert cluster.deletions[0]["name"] == leftover.name  # the leftover went first
    assert isinstance(leftover.job, k8s.V1Job)
    assert_torn_down(cluster)


def test_an_airflow_retry_gets_a_new_job_over_the_same_checkpoint_folder(cluster_for, tmp_path):
    cluster = cluster_for(kube_scenarios.nodes_run, fail_node=0)
    with pytest.raises(TrainingFailed):
        Job(make_spec(tmp_path, try_number=1)).run(lambda line: None)
    cluster.scenario = functools.partial(kube_scenarios.nodes_run, result={"resumed": True})
    assert Job(make_spec(tmp_path, try_number=2)).run(lambda line: None) == {"resumed": True}
    first, second = cluster.created_jobs
    assert first["metadata"]["name"] != second["metadata"]["name"]
    assert second["metadata"]["labels"]["pipeline.ddp/try_number"] == "2"
    envs = [cluster.pod_env(j) for j in (first, second)]
    assert envs[0]["PIPELINE_CHECKPOINT_DIR"] == envs[1]["PIPELINE_CHECKPOINT_DIR"] == str(tmp_path / "job" / "checkpoints")
    assert [e["PIPELINE_TRY_NUMBER"] for e in envs] == ["1", "2"]
    assert_torn_down(cluster)
