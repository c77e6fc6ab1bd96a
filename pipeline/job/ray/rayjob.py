"""A KubeRay ``RayJob`` (``ray.io/v1``) of one attempt of ``launch.kind = ray``: the cluster and the job in one
object that the KubeRay operator (1.6 or later) runs on Kubernetes; see docs/launching/ray.md.

The job is the one the Ray place submits through the Jobs API (``pipeline.job.ray.place.job_request``: the
same entrypoint, submission id, ``runtime_env`` and metadata), submitted by KubeRay's submitter Job
(``K8sJobMode``) to a Ray cluster made for it and deleted after it (``shutdownAfterJobFinishes``): a head and
``launch.nnodes`` workers on ``launch.kubernetes.image``, with a node's resources, the job folder's volumes and
a memory-backed ``/dev/shm`` as the Kubernetes place's pods have them (``pipeline.job.kubernetes.manifest``).

The official client has no RayJob model: the pod templates are the client's models (``V1PodTemplateSpec``)
serialized with its ``ApiClient``, and the RayJob is the dict around them (``templates`` reads them back).
"""

from __future__ import annotations

import json
from importlib import metadata
from typing import Any

import yaml
from kubernetes import client as k8s

from pipeline.launch_config import LaunchConfig
from pipeline.errors import ConfigError
from pipeline.job.kubernetes.manifest import (LABEL_PREFIX, check_job_folder, deserialize, node_container,
                                              node_pod_spec, object_labels, serialize)
from pipeline.job.ray.place import job_request
from pipeline.job.spec import Attempt

API_VERSION, KIND, PLURAL = "ray.io/v1", "RayJob", "rayjobs"
# KubeRay names the RayCluster NAME-xxxxx and refuses a RayJob name over 47 characters or not a DNS-1035 label.
MAX_NAME = 47
# Ray's default ports, which KubeRay's head Service exposes (ray start runs without port flags).
HEAD_PORTS = {"gcs-server": 6379, "dashboard": 8265, "client": 10001}
# The head runs Ray's control plane and the job's driver (the TorchTrainer), never a training worker
# (num-cpus 0): it needs no GPU and no node's worth of resources.
HEAD_RESOURCES = {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"memory": "4Gi"}}
# KubeRay's own default for the pod that runs `ray job submit`.
SUBMITTER_RESOURCES = {"requests": {"cpu": "500m", "memory": "200Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}
# What the Airflow worker's service account needs to manage RayJobs (the Role on docs/launching/ray.md).
ROLE_RULES = [{"apiGroups": ["ray.io"], "resources": [PLURAL], "verbs": ["create", "get", "list", "watch", "delete"]}]


def rayjob_for(attempt: Attempt) -> dict[str, Any]:
    """The RayJob of one attempt (``pipeline.job.spec.Attempt``), as the API takes it (JSON)."""
    spec = attempt.spec
    return build(name=rayjob_name(attempt.id), request=job_request(attempt, local=False), launch=spec.launch,
                 labels={**spec.labels, "restart": str(attempt.restart)}, job_dir=str(spec.files.root))


def rayjob_name(attempt_id: str) -> str:
    """The attempt's id (``pipeline.job.spec.attempt_id``) as a RayJob name: a letter first, at most 47
    characters, its digest and restart kept whole so that names stay unique."""
    readable, digest, restart = attempt_id.rsplit("-", 2)
    readable = readable if readable[:1].isalpha() else f"j{readable}"
    tail = f"-{digest}-{restart}"
    return readable[:MAX_NAME - len(tail)].rstrip("-") + tail


def build(*, name: str, request: dict[str, Any], launch: LaunchConfig, labels: dict[str, str],
          job_dir: str) -> dict[str, Any]:
    """The RayJob ``name`` running the Jobs API ``request`` (``job_request``'s) on a cluster of its own."""
    kube = launch.kubernetes
    check_job_folder(kube, job_dir)
    check_fits(launch)
    meta_labels, annotations = object_labels(name, labels)

    def template(role: str, container: k8s.V1Container, **fields: Any) -> dict[str, Any]:
        pod = node_pod_spec(launch, [container], **fields)
        return serialize(k8s.V1PodTemplateSpec(
            metadata=k8s.V1ObjectMeta(labels={**meta_labels, LABEL_PREFIX + "ray-node": role}, annotations=annotations),
            spec=pod))

    # KubeRay writes the Ray containers' command (ray start with num-cpus, memory and num-gpus from their
    # resources) and the submitter's (ray job submit): none is set here.
    head = template("head", node_container(
        launch, name="ray-head", resources=deserialize(HEAD_RESOURCES, "V1ResourceRequirements"),
        ports=[k8s.V1ContainerPort(name=port_name, container_port=port) for port_name, port in HEAD_PORTS.items()]))
    worker = template("worker", node_container(launch, name="ray-worker"))
    submitter = template("submitter", node_container(
        launch, name="ray-job-submitter", resources=deserialize(SUBMITTER_RESOURCES, "V1ResourceRequirements"),
        mounts=False), volumes=False, restart_policy="Never")
    job_labels = dict(meta_labels)
    if kube.queue_name:  # Kueue admits the RayJob (head and workers at once) and unsuspends it
        job_labels["kueue.x-k8s.io/queue-name"] = kube.queue_name
    nodes = launch.nnodes
    return {
        "apiVersion": API_VERSION, "kind": KIND,
        "metadata": {"name": name, "namespace": kube.namespace, "labels": job_labels, "annotations": annotations},
        "spec": {
            "entrypoint": request["entrypoint"],
            "jobId": request["submission_id"],  # a resubmission by the submitter Job finds it instead of duplicating
            "runtimeEnvYAML": yaml.safe_dump(request["runtime_env"], sort_keys=True),
            "metadata": request["metadata"],
            "entrypointNumCpus": request["entrypoint_num_cpus"],
            "submissionMode": "K8sJobMode",
            "submitterPodTemplate": submitter,
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": kube.ttl_after_finished_s,
            "backoffLimit": 0,  # a restart is a new RayJob (the attempt's -rN), as the supervisor's on every place
            "preRunningDeadlineSeconds": int(launch.ray.start_timeout_s),
            "activeDeadlineSeconds": int(launch.ray.start_timeout_s + launch.timeout_s),
            "suspend": bool(kube.queue_name),
            "rayClusterSpec": {
                "rayVersion": metadata.version("ray"),
                # Ray's token authentication: KubeRay makes the cluster's token Secret and gives it to every
                # pod and the submitter; without it, anyone reaching the dashboard could run any command.
                "authOptions": {"mode": "token"},
                "enableInTreeAutoscaling": False,
                "headGroupSpec": {"rayStartParams": {"num-cpus": "0"}, "template": head},
                "workerGroupSpecs": [{"groupName": "workers", "replicas": nodes, "minReplicas": nodes,
                                      "maxReplicas": nodes, "rayStartParams": {}, "template": worker}],
            },
        },
    }


def check_fits(launch: LaunchConfig) -> None:
    """Refuse a worker pod too small for its ``launch.nproc_per_node`` Ray Train workers (the job would wait
    for resources until ``launch.ray.start_timeout_s``)."""
    need_cpus = launch.nproc_per_node * launch.ray.cpus_per_worker
    if launch.cpus_per_node and launch.cpus_per_node < need_cpus:
        raise ConfigError(f"launch.cpus_per_node={launch.cpus_per_node:g}: each worker pod runs launch.nproc_per_node="
                          f"{launch.nproc_per_node} Ray Train workers of launch.ray.cpus_per_worker="
                          f"{launch.ray.cpus_per_worker:g} CPU, {need_cpus:g} in all; raise it or lower those")
    if launch.gpus_per_node and launch.gpus_per_node < launch.nproc_per_node:
        raise ConfigError(f"launch.gpus_per_node={launch.gpus_per_node}: each of the launch.nproc_per_node="
                          f"{launch.nproc_per_node} Ray Train workers of a pod takes one GPU")


def templates(body: dict[str, Any]) -> dict[str, k8s.V1PodTemplateSpec]:
    """The RayJob's pod templates (``head``, ``worker``, ``submitter``) read back into the client's models."""
    cluster = body["spec"]["rayClusterSpec"]
    (workers,) = cluster["workerGroupSpecs"]
    raw = {"head": cluster["headGroupSpec"]["template"], "worker": workers["template"],
           "submitter": body["spec"]["submitterPodTemplate"]}
    return {role: deserialize(template, "V1PodTemplateSpec") for role, template in raw.items()}


def runtime_env(body: dict[str, Any]) -> dict[str, Any]:
    """The job's ``runtime_env``, as KubeRay reads it from ``runtimeEnvYAML``."""
    return yaml.safe_load(body["spec"]["runtimeEnvYAML"])


def to_json(body: dict[str, Any]) -> str:
    """The RayJob as ``kubectl apply -f`` takes it (JSON is YAML)."""
    return json.dumps(body, indent=1, sort_keys=True)
