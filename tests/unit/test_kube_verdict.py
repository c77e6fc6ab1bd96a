"""The one verdict on a Kubernetes attempt's pods (pipeline.job.kubernetes.state.verdict), over the official client's
models: the place and the triggerer's watch both ask it (their runs against the stand-in API server are in
tests/unit/test_kube_launcher.py and tests/integration/test_place_contract.py)."""

from __future__ import annotations

from kubernetes import client as k8s

from pipeline.job.kubernetes.manifest import COMPLETION_INDEX
from pipeline.job.kubernetes.state import verdict


def pod(node: int, phase: str, *, waiting: str | None = None, exit_code: int | None = None,
        unschedulable: str | None = None) -> k8s.V1Pod:
    state = k8s.V1ContainerState(
        waiting=k8s.V1ContainerStateWaiting(reason=waiting, message=f"{waiting} detail") if waiting else None,
        running=k8s.V1ContainerStateRunning() if phase == "Running" else None,
        terminated=k8s.V1ContainerStateTerminated(exit_code=exit_code, reason="Error") if exit_code is not None else None)
    conditions = [k8s.V1PodCondition(type="PodScheduled", status="False", message=unschedulable)] if unschedulable else []
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name=f"job-{node}", annotations={COMPLETION_INDEX: str(node)}),
        status=k8s.V1PodStatus(phase=phase, conditions=conditions, container_statuses=[
            k8s.V1ContainerStatus(name="torchrun", image="img", image_id="", ready=phase == "Running",
                                  restart_count=0, state=state)]))


def job(condition: str | None = None) -> k8s.V1Job:
    conditions = [k8s.V1JobCondition(type=condition, status="True", reason=condition)] if condition else []
    return k8s.V1Job(spec=k8s.V1JobSpec(template=k8s.V1PodTemplateSpec()), status=k8s.V1JobStatus(conditions=conditions))


def judge(job_, pods, *, running=False, waited_s=1.0):
    return verdict(job_, pods, name="job", nnodes=2, running=running, waited_s=waited_s, schedule_timeout_s=60)


def test_pods_not_all_running_wait_and_say_why_per_node():
    now = judge(job(), [pod(0, "Running"), pod(1, "Pending", unschedulable="0/3 nodes have 8 GPUs")])
    assert not now.running and now.end is None
    assert now.detail == "node 1 (job-1): unschedulable: 0/3 nodes have 8 GPUs"


def test_an_image_that_can_never_be_pulled_ends_the_attempt_as_not_started_at_once():
    now = judge(job(), [pod(0, "Pending", waiting="InvalidImageName"), pod(1, "Running")])
    assert now.end.status == "not_started" and "InvalidImageName" in now.end.message


def test_waiting_past_the_schedule_timeout_is_not_started():
    now = judge(job(), [pod(0, "Running")], waited_s=61)
    assert now.end.status == "not_started" and "schedule_timeout_s=60s: node 1: no pod yet" in now.end.message


def test_once_running_the_first_failed_pod_ends_the_attempt_and_is_named():
    pods = [pod(0, "Running"), pod(1, "Failed", exit_code=137)]
    now = judge(job(), pods, running=True)
    assert now.end.status == "failed" and now.failed_pods == ("job-1",)
    assert "node 1 (pod job-1) exited with code 137" in now.end.message
    assert judge(job(), [pod(0, "Running"), pod(1, "Running")], running=True) == judge(
        job(), [pod(0, "Running"), pod(1, "Running")])  # all running: the same verdict whatever was seen before


def test_a_completed_job_succeeds_even_when_its_pods_were_never_seen_running():
    now = judge(job("Complete"), [pod(0, "Succeeded", exit_code=0), pod(1, "Succeeded", exit_code=0)])
    assert now.running and now.end.status == "succeeded"
