"""The KubeRay RayJob of ``launch.kind = ray`` (pipeline/job/ray/rayjob.py): its pod templates built with the
official client's models and read back through them, the job the Ray place submits, and the Role on
docs/launching/ray.md (no cluster or KubeRay operator runs here)."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import asdict, fields
from importlib import metadata

import pytest
import yaml
from kubernetes import client as k8s

from pipeline import deployment
from pipeline.errors import ConfigError
from pipeline.job.kubernetes.manifest import deserialize, serialize
from pipeline.job.ray.place import job_request
from pipeline.job.ray.rayjob import (
    MAX_NAME,
    ROLE_RULES,
    rayjob_for,
    rayjob_name,
    runtime_env,
    templates,
)
from pipeline.job.spec import Attempt, JobSpec, attempt_id, launch_config
from tests.unit.test_kube_manifest import AFFINITY, JOB_DIR, KUBERNETES

ENTRY = ["-m", "pipeline.rank", "--recipe", "image_classifier", "--config", f"{JOB_DIR}/config.json"]


def every_setting(launch: dict | None = None, **kube) -> JobSpec:
    options = {
        "kind": "ray", "nnodes": 2, "nproc_per_node": 8, "gpus_per_node": 8, "cpus_per_node": 90,
        "memory_per_node_gb": 900, "timeout_s": 7200, "grace_period_s": 30, "backend": "nccl",
        "ray": {"cpus_per_worker": 4, "start_timeout_s": 900},
        "kubernetes": {**KUBERNETES, **kube},
        **(launch or {}),
    }
    return JobSpec(entry=ENTRY, job_dir=JOB_DIR, launch=launch_config(options), name="ddp-train-1", try_number=1,
                   env={"MLFLOW_TRACKING_URI": "http://mlflow.mlops:5000", "MLFLOW_RUN_ID": "0123abcd",
                        "MLFLOW_TRACKING_PASSWORD": "never-in-the-manifest"},
                   labels={"dag_id": "ddp", "run_id": "manual__2026-11-30T12:00:00+00:00", "task_id": "train",
                           "map_index": "-1", "try_number": "1"})


def test_2_nodes_x_8_gpus_round_trip_through_the_client_models_with_every_setting():
    attempt = Attempt(every_setting(), 1)
    body = rayjob_for(attempt)
    text = json.dumps(body)
    again = json.loads(text)
    assert again == body
    built = templates(body)
    read = templates(again)  # through the client's deserializer: required fields and enums checked
    for role in ("head", "worker", "submitter"):
        assert isinstance(read[role], k8s.V1PodTemplateSpec) and read[role] == built[role], role
    assert serialize(read["head"]) == again["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]  # no key the models lack
    assert serialize(read["worker"]) == again["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]
    assert serialize(read["submitter"]) == again["spec"]["submitterPodTemplate"]

    assert (body["apiVersion"], body["kind"]) == ("ray.io/v1", "RayJob")
    meta, spec = body["metadata"], body["spec"]
    assert meta["namespace"] == "training" and meta["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert meta["labels"]["pipeline.ddp/job"] == meta["name"] and meta["labels"]["pipeline.ddp/restart"] == "1"
    assert meta["annotations"]["pipeline.ddp/run_id"] == "manual__2026-11-30T12:00:00+00:00"
    # The job the Ray place submits through the Jobs API, unchanged.
    request = job_request(attempt, local=False)
    assert spec["entrypoint"] == request["entrypoint"] and spec["jobId"] == attempt.id
    assert runtime_env(body) == request["runtime_env"] and spec["metadata"] == request["metadata"]
    assert spec["entrypointNumCpus"] == request["entrypoint_num_cpus"]
    assert (spec["submissionMode"], spec["shutdownAfterJobFinishes"], spec["ttlSecondsAfterFinished"]) == ("K8sJobMode", True, 600)
    assert (spec["backoffLimit"], spec["preRunningDeadlineSeconds"], spec["activeDeadlineSeconds"]) == (0, 900, 900 + 7200)
    assert spec["suspend"] is True  # Kueue admits it

    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == metadata.version("ray") and cluster["authOptions"] == {"mode": "token"}
    assert cluster["enableInTreeAutoscaling"] is False
    assert cluster["headGroupSpec"]["rayStartParams"] == {"num-cpus": "0"}  # no training worker on the head
    (group,) = cluster["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 2, 2)

    head, worker, submitter = (built[r].spec for r in ("head", "worker", "submitter"))
    for pod in (head, worker, submitter):
        (container,) = pod.containers
        assert container.command is None and container.args is None  # KubeRay writes ray start / ray job submit
        assert container.image == "registry.example.com/ml/ddp-pipelines:1.4.0" and container.image_pull_policy == "Always"
        assert container.security_context.run_as_non_root and container.security_context.run_as_user == 1000
        assert container.security_context.allow_privilege_escalation is False
        assert [s.secret_ref.name for s in container.env_from] == ["mlflow-credentials", "s3-credentials"]
        assert pod.service_account_name == "ddp-trainer" and pod.priority_class_name == "training-high"
        assert [s.name for s in pod.image_pull_secrets] == ["registry-creds"]
        assert pod.node_selector == {"nvidia.com/gpu.present": "true", "pool": "h100"}
        assert serialize(pod.affinity) == AFFINITY and len(pod.tolerations) == 2
    assert [c.name for c in (head.containers[0], worker.containers[0], submitter.containers[0])] == [
        "ray-head", "ray-worker", "ray-job-submitter"]
    assert serialize(worker.containers[0].resources) == {
        "requests": {"nvidia.com/gpu": "8", "cpu": "90", "memory": "900Gi"},
        "limits": {"nvidia.com/gpu": "8", "cpu": "95500m", "memory": "960Gi"}}
    assert "nvidia.com/gpu" not in json.dumps(serialize(head.containers[0].resources))
    assert {p.name: p.container_port for p in head.containers[0].ports} == {"gcs-server": 6379, "dashboard": 8265, "client": 10001}
    for pod in (head, worker):  # the job folder where the Airflow worker has it; shm in memory
        assert serialize(pod.volumes) == [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}},
            {"name": "data-0", "persistentVolumeClaim": {"claimName": "pipeline-home"}},
            {"name": "data-1", "persistentVolumeClaim": {"claimName": "datasets"}}]
        assert [(m.name, m.mount_path) for m in pod.containers[0].volume_mounts] == [
            ("dshm", "/dev/shm"), ("data-0", "/mnt/pipeline"), ("data-1", "/mnt/datasets")]
    assert submitter.volumes is None and submitter.restart_policy == "Never"
    assert "never-in-the-manifest" not in text and "MLFLOW_TRACKING_PASSWORD" not in text


def test_the_entrypoint_is_the_ray_entry_over_the_same_rank_entry():
    spec = every_setting()
    body = rayjob_for(Attempt(spec, 0))
    argv = shlex.split(body["spec"]["entrypoint"])
    assert argv[:4] == ["python", "-m", "pipeline.job.ray.entry", "--job"]
    assert argv[5] == "--" and argv[6:] == ENTRY
    job = json.loads(argv[4])
    assert job["launch"] == asdict(spec.launch) and job["job_dir"] == JOB_DIR
    assert job["storage"].startswith("/mnt/pipeline/")  # checkpoints on the shared volume
    env = runtime_env(body)["env_vars"]
    assert env["MLFLOW_RUN_ID"] == "0123abcd" and env["PIPELINE_JOB_DIR"] == JOB_DIR
    ray_python = rayjob_for(Attempt(every_setting({"ray": {"python": "/opt/venv/bin/python"}}), 0))
    assert shlex.split(ray_python["spec"]["entrypoint"])[0] == "/opt/venv/bin/python"


def test_every_launch_kubernetes_field_that_shapes_pods_reaches_the_rayjob():
    """A guard for fields added later: each one set to a non-default value changes the RayJob beyond its
    entrypoint (which carries the whole launch config anyway)."""
    def shape(body: dict) -> str:
        return json.dumps({**body, "spec": {k: v for k, v in body["spec"].items() if k != "entrypoint"}})

    base = shape(rayjob_for(Attempt(every_setting(), 0)))
    changed = {"image": "other:1", "image_pull_policy": "Never", "image_pull_secrets": ["x"], "namespace": "ns2",
               "service_account": "sa2", "gpu_resource": "amd.com/gpu", "cpu_limit": 300.0, "memory_limit_gb": 5.0,
               "shm_size_gb": 1.0, "node_selector": ["a=b"], "tolerations": ["k:NoSchedule"],
               "affinity": json.dumps({"podAntiAffinity": {}}), "priority_class": "p2", "volumes": ["c:/mnt/pipeline"],
               "env_from_secrets": ["s2"], "run_as_user": 2000, "ttl_after_finished_s": 1, "queue_name": "q2"}
    # Where the launcher connects, how the task waits, and the torchrun Job's own deployment.
    not_in_rayjob = {"connection_id", "deferrable", "master_port", "schedule_timeout_s"}
    assert set(changed) | not_in_rayjob == {f.name for f in fields(type(every_setting().launch.kubernetes))}
    for name, value in changed.items():
        assert shape(rayjob_for(Attempt(every_setting(**{name: value}), 0))) != base, name


def test_names_are_dns_1035_labels_that_kuberay_accepts_and_stay_unique():
    labels = {"dag_id": "2026_reports", "run_id": "r", "task_id": "train", "try_number": "1"}
    ids = [attempt_id(name, {**labels, "try_number": t}, r) for name in ("9" * 300, "a" * 300, "ddp-train-1", "-x-")
           for t in ("1", "2") for r in (0, 1, 42)]
    names = [rayjob_name(i) for i in ids]
    assert len(set(names)) == len(ids)
    for name in names:
        assert len(name) <= MAX_NAME == 47 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name), name
    assert rayjob_name("ddp-train-1-773893db-r0") == "ddp-train-1-773893db-r0"  # a name that fits is kept


@pytest.mark.parametrize("override, message", [
    ({"kubernetes": {"volumes": ["datasets:/mnt/datasets"]}}, f"the job folder {JOB_DIR} must lie on a volume"),
    ({"kubernetes": {"volumes": ["pipeline-home"]}}, "launch.kubernetes.volumes item 'pipeline-home'"),
    ({"kubernetes": {"tolerations": ["gpu"]}}, "launch.kubernetes.tolerations item 'gpu'"),
    ({"cpus_per_node": 16}, "launch.cpus_per_node=16: each worker pod runs launch.nproc_per_node=8 Ray Train workers"),
    ({"gpus_per_node": 4}, "launch.gpus_per_node=4: each of the launch.nproc_per_node=8 Ray Train workers"),
])
def test_bad_settings_name_the_field_the_value_and_what_is_expected(override, message):
    spec = every_setting()
    options = asdict(spec.launch)
    for key, value in override.items():
        options[key] = {**options[key], **value} if isinstance(value, dict) else value
    with pytest.raises(ConfigError) as err:
        rayjob_for(Attempt(JobSpec(entry=ENTRY, job_dir=JOB_DIR, launch=launch_config(options), labels=spec.labels), 0))
    assert message in str(err.value)


def test_the_role_on_the_ray_page_grants_what_managing_rayjobs_needs():
    """The YAML on docs/launching/ray.md is valid RBAC for the client's models, and its Role is ROLE_RULES."""
    page = (deployment.PROJECT_ROOT / "docs" / "launching" / "ray.md").read_text()
    section = page[page.index("## On Kubernetes with KubeRay"):]
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.S)
    objects = [o for block in blocks for o in yaml.safe_load_all(block) if o]
    kinds = {o["kind"]: o for o in objects}
    role = deserialize(kinds["Role"], "V1Role")
    binding = deserialize(kinds["RoleBinding"], "V1RoleBinding")
    assert serialize(role)["rules"] == ROLE_RULES
    assert (binding.role_ref.kind, binding.role_ref.name) == ("Role", role.metadata.name)
    assert binding.metadata.namespace == role.metadata.namespace and binding.subjects[0].kind == "ServiceAccount"
