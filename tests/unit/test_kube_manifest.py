"""The Job and Service of ``launch.kind = kubernetes``, built with the official client's models and checked
against them (no cluster runs here: the API server's own validation cannot be asked)."""

from __future__ import annotations

import json
import re

import pytest
from kubernetes import client as k8s

from pipeline.errors import ConfigError
from pipeline.job.kubernetes.manifest import COMPLETION_INDEX, deserialize, serialize
from pipeline.job.kubernetes.place import manifests_for
from pipeline.job.spec import Attempt, JobSpec, attempt_id, launch_config
from tests.kube_standin import rendered_pod

JOB_DIR = "/mnt/pipeline/runs/ddp/manual__2026-11-30T12_00_00_00_00/train"
AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]}]}]}}}


# Every launch.kubernetes setting that shapes a pod, away from its default (the RayJob's tests use them too).
KUBERNETES = {
    "image": "registry.example.com/ml/ddp-pipelines:1.4.0", "image_pull_policy": "Always",
    "image_pull_secrets": ["registry-creds"], "namespace": "training", "service_account": "ddp-trainer",
    "gpu_resource": "nvidia.com/gpu", "cpu_limit": 95.5, "memory_limit_gb": 960, "shm_size_gb": 64,
    "node_selector": ["nvidia.com/gpu.present=true", "pool=h100"],
    "tolerations": ["nvidia.com/gpu:NoSchedule", "dedicated=training:NoExecute"],
    "affinity": json.dumps(AFFINITY), "priority_class": "training-high",
    "volumes": ["pipeline-home:/mnt/pipeline", "datasets:/mnt/datasets"],
    "env_from_secrets": ["mlflow-credentials", "s3-credentials"], "run_as_user": 1000,
    "ttl_after_finished_s": 600, "queue_name": "gpu-queue",
}


def every_setting(**extra) -> JobSpec:
    launch = launch_config({
        "kind": "kubernetes", "nnodes": 2, "nproc_per_node": 8, "gpus_per_node": 8, "cpus_per_node": 90,
        "memory_per_node_gb": 900, "timeout_s": 7200, "grace_period_s": 30, "backend": "nccl",
        "kubernetes": {**KUBERNETES, "master_port": 29400, "schedule_timeout_s": 900, **extra},
    })
    return JobSpec(entry=["-m", "pipeline.rank", "--recipe", "tabular_mlp", "--config", f"{JOB_DIR}/config.json"],
                   job_dir=JOB_DIR, launch=launch, name="ddp-train-1", try_number=1,
                   env={"MLFLOW_TRACKING_URI": "http://mlflow.mlops:5000", "MLFLOW_RUN_ID": "0123abcd"},
                   labels={"dag_id": "ddp", "run_id": "manual__2026-11-30T12:00:00+00:00", "task_id": "train",
                           "map_index": "-1", "try_number": "1"})


def round_trip(obj, model: str):
    """Serialize to the API's JSON text and read it back through the client's models (which check
    required fields and enums, and drop keys that the OpenAPI models do not define)."""
    text = json.dumps(serialize(obj))
    again = deserialize(json.loads(text), model)
    return text, again


def test_2_nodes_x_8_gpus_round_trip_through_the_client_models_with_every_setting():
    m = manifests_for(Attempt(every_setting(), 0))
    for obj, model in ((m.job, "V1Job"), (m.service, "V1Service")):
        text, again = round_trip(obj, model)
        assert again == obj
        assert serialize(again) == json.loads(text)  # no key the OpenAPI models lack

    job = serialize(m.job)
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == ("Indexed", 2, 2, 0)
    assert spec["activeDeadlineSeconds"] == 900 + 7200 and spec["ttlSecondsAfterFinished"] == 600
    assert spec["suspend"] is True and job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert job["metadata"]["namespace"] == "training"
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == m.service.metadata.name
    assert pod["serviceAccountName"] == "ddp-trainer" and pod["priorityClassName"] == "training-high"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true", "pool": "h100"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                  {"key": "dedicated", "operator": "Equal", "value": "training", "effect": "NoExecute"}]
    assert pod["affinity"] == AFFINITY
    assert pod["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert pod["terminationGracePeriodSeconds"] == 30
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["volumes"] == [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}},
        {"name": "data-0", "persistentVolumeClaim": {"claimName": "pipeline-home"}},
        {"name": "data-1", "persistentVolumeClaim": {"claimName": "datasets"}}]
    (container,) = pod["containers"]
    assert container["image"] == "registry.example.com/ml/ddp-pipelines:1.4.0" and container["imagePullPolicy"] == "Always"
    assert container["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000, "allowPrivilegeEscalation": False,
                                            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
    assert container["resources"] == {"requests": {"nvidia.com/gpu": "8", "cpu": "90", "memory": "900Gi"},
                                      "limits": {"nvidia.com/gpu": "8", "cpu": "95500m", "memory": "960Gi"}}
    assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"},
                                         {"name": "data-0", "mountPath": "/mnt/pipeline"},
                                         {"name": "data-1", "mountPath": "/mnt/datasets"}]
    assert container["envFrom"] == [{"secretRef": {"name": "mlflow-credentials"}}, {"secretRef": {"name": "s3-credentials"}}]
    env = {e["name"]: e for e in container["env"]}
    assert env["PET_NODE_RANK"]["valueFrom"] == {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}
    assert {k: env[k]["value"] for k in ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_MASTER_PORT")} == {
        "PET_NNODES": "2", "PET_NPROC_PER_NODE": "8", "PET_MASTER_PORT": "29400"}
    assert env["PET_MASTER_ADDR"]["value"] == f"{m.name}-0.{m.service.metadata.name}"
    assert env["PIPELINE_CHECKPOINT_DIR"]["value"] == f"{JOB_DIR}/checkpoints"
    assert env["PIPELINE_BACKEND"]["value"] == "nccl"
    assert container["command"][:4] == ["python", "-m", "torch.distributed.run", "--tee=3"]
    assert container["command"][-6:] == ["-m", "pipeline.rank", "--recipe", "tabular_mlp", "--config", f"{JOB_DIR}/config.json"]
    assert "SECRET" not in json.dumps(job).upper().replace("IMAGEPULLSECRETS", "").replace("SECRETREF", "")

    service = serialize(m.service)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"pipeline.ddp/job": m.name}
    assert service["spec"]["ports"] == [{"name": "rdzv", "port": 29400, "targetPort": 29400}]


def test_every_launch_kubernetes_field_reaches_the_manifest():
    """A guard for fields added later: each one set to a non-default value changes the Job or Service."""
    from dataclasses import fields

    from pipeline.launch_config import KubernetesConfig

    base = json.dumps([serialize(o) for o in (manifests_for(Attempt(every_setting(), 0)).job, manifests_for(Attempt(every_setting(), 0)).service)])
    changed = {"image": "other:1", "image_pull_policy": "Never", "image_pull_secrets": ["x"], "namespace": "ns2",
               "service_account": "sa2", "gpu_resource": "amd.com/gpu", "cpu_limit": 3.0, "memory_limit_gb": 5.0,
               "shm_size_gb": 1.0, "node_selector": ["a=b"], "tolerations": ["k:NoSchedule"],
               "affinity": json.dumps({"podAntiAffinity": {}}), "priority_class": "p2", "volumes": ["c:/mnt/pipeline"],
               "env_from_secrets": ["s2"], "run_as_user": 2000, "master_port": 29600, "schedule_timeout_s": 60.0,
               "ttl_after_finished_s": 1, "queue_name": "q2"}
    not_in_manifest = {"connection_id", "deferrable"}  # where the launcher connects, how the task waits
    assert set(changed) | not_in_manifest == {f.name for f in fields(KubernetesConfig)}
    for name, value in changed.items():
        m = manifests_for(Attempt(every_setting(**{name: value}), 0))
        assert json.dumps([serialize(m.job), serialize(m.service)]) != base, name


def test_names_are_unique_per_run_try_and_restart_and_fit_a_pod_hostname():
    labels = {"dag_id": "a" * 200, "run_id": "scheduled__2026-11-30T00:00:00+00:00", "task_id": "train", "try_number": "1"}
    names = {attempt_id("x" * 300, {**labels, "run_id": run, "try_number": t}, r)
             for run in ("r1", "r2") for t in ("1", "2") for r in (0, 1)}
    assert len(names) == 8
    for name in names:
        assert len(name) <= 52 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name


def test_the_rendered_pod_is_what_the_kubelet_would_run():
    m = manifests_for(Attempt(every_setting(), 1))
    command, env = rendered_pod(m, 1)
    assert env["PET_NODE_RANK"] == "1" and env["PIPELINE_RESTART_COUNT"] == "1"
    assert f"--log-dir={JOB_DIR}/logs-try1/torchrun-1/node-1" in command


@pytest.mark.parametrize("override, message", [
    ({"tolerations": ["gpu"]}, "launch.kubernetes.tolerations item 'gpu': expected KEY=VALUE:EFFECT or KEY:EFFECT"),
    ({"node_selector": ["pool"]}, "launch.kubernetes.node_selector item 'pool': expected KEY=VALUE"),
    ({"affinity": "{nodeAffinity"}, "launch.kubernetes.affinity='{nodeAffinity': expected JSON"),
    ({"affinity": '{"nodeAfinity": {}}'}, "expected an object with nodeAffinity"),
    ({"volumes": ["pipeline-home"]}, "launch.kubernetes.volumes item 'pipeline-home': expected CLAIM:/MOUNT/PATH"),
    ({"volumes": ["datasets:/mnt/datasets"]}, f"the job folder {JOB_DIR} must lie on a volume mounted in the pods"),
])
def test_bad_settings_name_the_field_the_value_and_what_is_expected(override, message):
    with pytest.raises(ConfigError) as err:
        manifests_for(Attempt(every_setting(**override), 0))
    assert message in str(err.value)


def test_launch_kubernetes_is_chosen_per_run_by_overrides_and_checked_like_any_field():
    from pipeline.recipes import get_recipe

    recipe = get_recipe("tabular_mlp")
    cfg = recipe.config_from_params({"overrides": {"launch.kind": "kubernetes", "launch.nnodes": 2,
                                                   "launch.kubernetes.image": "reg/ddp:2"}})
    assert (cfg.launch.kind, cfg.launch.nnodes, cfg.launch.kubernetes.image) == ("kubernetes", 2, "reg/ddp:2")
    # Where it runs is no part of the MLflow params (what is trained is): they read back without it.
    assert type(cfg).from_flat(cfg.as_params()).settings() == cfg.settings()
    assert [key for key in cfg.as_params() if key.startswith("launch.")] == []
    assert recipe.config().launch.kind == "local"  # the default (and make demo) stays local
    with pytest.raises(ConfigError, match="launch.kubernetes.shm_size_gb=0.0: expected a value >= 0.0625"):
        recipe.config().with_overrides({"launch.kubernetes.shm_size_gb": 0})
    with pytest.raises(ConfigError, match="unknown config key 'launch.kubernetes.imag'"):
        recipe.config().with_overrides({"launch.kubernetes.imag": "x"})
    assert isinstance(manifests_for(Attempt(JobSpec(entry=["t.py"], job_dir="/w/j", launch=launch_config(
        {"kind": "kubernetes", "kubernetes": {"volumes": ["home:/w"]}})), 0)).job, k8s.V1Job)


def test_the_default_image_is_the_dockerfiles_and_runs_as_its_non_root_user():
    from pathlib import Path

    from pipeline.launch_config import KubernetesConfig

    dockerfile = (Path(__file__).parents[2] / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", dockerfile, re.M)
    assert users and users[-1] == str(KubernetesConfig().run_as_user) != "0"
    assert f"docker build -t {KubernetesConfig().image} ." in dockerfile
    assert "pip install -r /tmp/requirements.txt" in dockerfile  # torch and the rest as pinned
    settings = re.findall(r"^(?:ENV|ARG)\s+(.*(?:\n\s+.*\\?)*)", dockerfile, re.M)
    assert not re.search(r"PASSWORD|SECRET|TOKEN|_KEY", " ".join(settings), re.I)
    assert ".env" in (Path(__file__).parents[2] / ".dockerignore").read_text().split()


def test_an_elastic_job_asks_torchrun_for_a_range_of_nodes_and_kubernetes_refuses_it(tmp_path):
    from pipeline.job.kubernetes.manifest import check
    from pipeline.job.local.place import torchrun_command

    elastic = torchrun_command(["x.py"], nproc_per_node=2, nnodes=4, min_nnodes=2, rdzv_endpoint="h:29400",
                               log_dir=tmp_path)
    fixed = torchrun_command(["x.py"], nproc_per_node=2, nnodes=4, rdzv_endpoint="h:29400", log_dir=tmp_path)
    assert "--nnodes=2:4" in elastic and "--nnodes=4" in fixed
    with pytest.raises(ConfigError, match="launch.min_nnodes=1: the Kubernetes place runs an indexed Job"):
        check(launch_config({"kind": "kubernetes", "nnodes": 2, "min_nnodes": 1}), str(tmp_path))


def test_secrets_in_the_ranks_environment_never_reach_the_manifest_and_are_named_in_the_log(caplog):
    import dataclasses

    spec = every_setting()
    spec = dataclasses.replace(spec, env={**spec.env, "AWS_SECRET_ACCESS_KEY": "wJalr-secret",
                                          "MLFLOW_TRACKING_PASSWORD": "mlflow-secret", "AWS_ENDPOINT_URL": "http://minio:9000"})
    with caplog.at_level("WARNING"):
        m = manifests_for(Attempt(spec, 0))
    rendered = json.dumps([serialize(m.job), serialize(m.service)])
    assert "wJalr-secret" not in rendered and "mlflow-secret" not in rendered
    assert "http://minio:9000" in rendered  # the rest of the environment is the pods'
    assert "AWS_SECRET_ACCESS_KEY, MLFLOW_TRACKING_PASSWORD" in caplog.text  # by name only
    assert "wJalr-secret" not in caplog.text and "mlflow-secret" not in caplog.text
