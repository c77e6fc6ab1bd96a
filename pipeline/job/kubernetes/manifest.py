"""The Kubernetes objects of one training attempt (``launch.kind = kubernetes``), built with the official
client's models: an indexed Job of ``launch.nnodes`` pods and a headless Service that gives pod 0 a
stable DNS name (the Kubeflow Trainer / JobSet shape).

Each pod runs ``torchrun`` over the same entry the local place runs, configured by the ``PET_*``
variables torchrun reads: ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` (the pod's
completion index, from the ``batch.kubernetes.io/job-completion-index`` annotation),
``PET_MASTER_ADDR`` (pod 0: ``JOB-0.SERVICE``) and ``PET_MASTER_PORT``: torchrun's static rendezvous,
whose store pod 0's agent hosts.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from kubernetes import client as k8s

from pipeline.launch_config import KubernetesConfig, LaunchConfig
from pipeline.errors import ConfigError

COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
LABEL_PREFIX = "pipeline.ddp/"
JOB_LABEL = LABEL_PREFIX + "job"
CONTAINER = "torchrun"
SHM_VOLUME = "dshm"
JOB_FOLDER_VOLUME = "job-folder"  # a pod's own job folder, when the job folder's copy is on an object store


@dataclass(frozen=True)
class Manifests:
    job: k8s.V1Job
    service: k8s.V1Service

    @property
    def name(self) -> str:
        return self.job.metadata.name

    @property
    def namespace(self) -> str:
        return self.job.metadata.namespace

    @property
    def selector(self) -> str:
        """Label selector of the attempt's pods."""
        return f"{JOB_LABEL}={self.name}"

    @classmethod
    def named(cls, namespace: str, name: str) -> "Manifests":
        """The attempt's objects by name alone: what deleting them needs."""
        meta = k8s.V1ObjectMeta(name=name, namespace=namespace)
        return cls(job=k8s.V1Job(metadata=meta), service=k8s.V1Service(metadata=meta))


def label_value(text: str) -> str:
    """A label value (63 characters of ``[A-Za-z0-9._-]``, alphanumeric at both ends); the exact
    text goes in an annotation beside it."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "_", str(text))[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


def build(*, name: str, entry: list[str], launch: LaunchConfig, env: dict[str, str], labels: dict[str, str],
          log_dir: str, job_dir: str, no_python: bool = False, store: str | None = None) -> Manifests:
    """The Job and Service of one attempt. ``env``: the ranks' environment (the job folder's
    ``PIPELINE_*`` paths, MLflow's URI and run id); secrets go by reference (``env_from_secrets``).
    ``store``: the job folder's copy on an object store (``pipeline.job.mirror``): each pod then runs torchrun under
    the mirror's agent, in a job folder of its own (an emptyDir at the same path), and needs no shared volume."""
    from pipeline.job.mirror import agent_command

    kube = launch.kubernetes
    check(launch, job_dir, shared=store is None)
    service_name = name
    meta_labels, annotations = object_labels(name, labels)
    torchrun = ["python", "-m", "torch.distributed.run", "--tee=3", f"--log-dir={log_dir}/node-$(PET_NODE_RANK)",
                *(["--no-python"] if no_python else []), *entry]
    container = node_container(
        launch, name=CONTAINER, command=agent_command(store, job_dir, "$(PET_NODE_RANK)", torchrun) if store else torchrun,
        env=pod_env(name, service_name, launch, env), ports=[k8s.V1ContainerPort(container_port=kube.master_port, name="rdzv")])
    pod = node_pod_spec(launch, [container], restart_policy="Never", subdomain=service_name)
    if store:
        container.volume_mounts.append(k8s.V1VolumeMount(name=JOB_FOLDER_VOLUME, mount_path=job_dir))
        pod.volumes.append(k8s.V1Volume(name=JOB_FOLDER_VOLUME, empty_dir=k8s.V1EmptyDirVolumeSource()))
    job_labels = dict(meta_labels)
    if kube.queue_name:
        job_labels["kueue.x-k8s.io/queue-name"] = kube.queue_name
    job = k8s.V1Job(
        api_version="batch/v1", kind="Job",
        metadata=k8s.V1ObjectMeta(name=name, namespace=kube.namespace, labels=job_labels, annotations=annotations),
        spec=k8s.V1JobSpec(
            completion_mode="Indexed", completions=launch.nnodes, parallelism=launch.nnodes, backoff_limit=0,
            active_deadline_seconds=int(kube.schedule_timeout_s + launch.timeout_s),
            ttl_seconds_after_finished=kube.ttl_after_finished_s, suspend=bool(kube.queue_name),
            template=k8s.V1PodTemplateSpec(
                metadata=k8s.V1ObjectMeta(labels=meta_labels, annotations=annotations), spec=pod),
        ),
    )
    service = k8s.V1Service(
        api_version="v1", kind="Service",
        metadata=k8s.V1ObjectMeta(name=service_name, namespace=kube.namespace, labels=meta_labels, annotations=annotations),
        spec=k8s.V1ServiceSpec(
            cluster_ip="None", publish_not_ready_addresses=True, selector={JOB_LABEL: name},
            ports=[k8s.V1ServicePort(name="rdzv", port=kube.master_port, target_port=kube.master_port)]),
    )
    return Manifests(job=job, service=service)


def object_labels(name: str, labels: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Labels (``pipeline.ddp/job`` = ``name``, each of ``labels`` as a label value) and annotations (their
    exact text) of an attempt's objects and pods."""
    meta_labels = {JOB_LABEL: name, **{LABEL_PREFIX + k: label_value(v) for k, v in labels.items()}}
    return meta_labels, {LABEL_PREFIX + k: str(v) for k, v in labels.items()}


def node_container(launch: LaunchConfig, *, name: str, command: list[str] | None = None,
                   env: list[k8s.V1EnvVar] | None = None, ports: list[k8s.V1ContainerPort] | None = None,
                   resources: k8s.V1ResourceRequirements | None = None, mounts: bool = True) -> k8s.V1Container:
    """A container of ``launch.kubernetes.image`` as every pod of a job runs it: non-root without privileges,
    a node's resources (``resources`` replaces them), the volumes and ``/dev/shm`` mounted (unless
    ``mounts`` is false), secrets by reference only."""
    kube = launch.kubernetes
    return k8s.V1Container(
        name=name, image=kube.image, image_pull_policy=kube.image_pull_policy, command=command, env=env, ports=ports,
        env_from=[k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=s)) for s in kube.env_from_secrets] or None,
        resources=resources or _resources(launch), volume_mounts=_mounts(kube) if mounts else None,
        security_context=k8s.V1SecurityContext(
            run_as_non_root=True, run_as_user=kube.run_as_user, allow_privilege_escalation=False,
            capabilities=k8s.V1Capabilities(drop=["ALL"]), seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault")),
        termination_message_policy="FallbackToLogsOnError",
    )


def node_pod_spec(launch: LaunchConfig, containers: list[k8s.V1Container], *, volumes: bool = True,
                  **fields: Any) -> k8s.V1PodSpec:
    """The pod spec every pod of a job shares: service account, scheduling (node selector, tolerations,
    affinity, priority class), image pull secrets, the volumes (unless ``volumes`` is false), the grace
    period and a non-root security context; ``fields``: the rest (``restart_policy``, ``subdomain``)."""
    kube = launch.kubernetes
    return k8s.V1PodSpec(
        containers=containers, service_account_name=kube.service_account or None,
        node_selector=dict(_pair(s, "launch.kubernetes.node_selector") for s in kube.node_selector) or None,
        tolerations=[_toleration(t) for t in kube.tolerations] or None,
        affinity=_affinity(kube.affinity), priority_class_name=kube.priority_class or None,
        image_pull_secrets=[k8s.V1LocalObjectReference(name=s) for s in kube.image_pull_secrets] or None,
        volumes=_volumes(kube) if volumes else None, termination_grace_period_seconds=int(launch.grace_period_s),
        security_context=k8s.V1PodSecurityContext(
            run_as_non_root=True, run_as_user=kube.run_as_user, fs_group=kube.run_as_user,  # group 0: the image's
            seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault")),
        **fields,
    )


def master_addr(name: str, service_name: str) -> str:
    """Pod 0's DNS name: its hostname (``JOB-0``) in the headless Service's subdomain."""
    return f"{name}-0.{service_name}"


def pod_env(name: str, service_name: str, launch: LaunchConfig, env: dict[str, str]) -> list[k8s.V1EnvVar]:
    node_rank = k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(
        field_path=f"metadata.annotations['{COMPLETION_INDEX}']"))
    values = {
        **env,
        "PET_NNODES": str(launch.nnodes), "PET_NPROC_PER_NODE": str(launch.nproc_per_node),
        "PET_MASTER_ADDR": master_addr(name, service_name), "PET_MASTER_PORT": str(launch.kubernetes.master_port),
        "PET_RDZV_ID": name, "PYTHONUNBUFFERED": "1",
    }
    return [k8s.V1EnvVar(name="PET_NODE_RANK", value_from=node_rank)] + [
        k8s.V1EnvVar(name=key, value=value) for key, value in sorted(values.items())]


def check(launch: LaunchConfig, job_dir: str, *, shared: bool = True) -> None:
    """Refuse what would fail in the cluster: a ``shared`` job folder must be on a mounted volume."""
    kube = launch.kubernetes
    if launch.min_nnodes:
        raise ConfigError(f"launch.min_nnodes={launch.min_nnodes}: the Kubernetes place runs an indexed Job of exactly "
                          f"launch.nnodes pods; elastic jobs run on the local place or on Ray")
    if shared:
        check_job_folder(kube, job_dir)


def check_job_folder(kube: KubernetesConfig, job_dir: str) -> None:
    """Refuse a job folder that no volume of ``launch.kubernetes.volumes`` holds at the same path."""
    for item in kube.volumes:
        _volume(item)
    mounts = [PurePosixPath(_volume(item)[1]) for item in kube.volumes]
    folder = PurePosixPath(job_dir)
    if not any(folder == m or m in folder.parents for m in mounts):
        raise ConfigError(
            f"launch.kubernetes.volumes={kube.volumes!r}: the job folder {job_dir} must lie on a volume mounted "
            f"in the pods at the same path (CLAIM:MOUNT_PATH, the claim the Airflow workers mount there too), "
            f"so that every pod reads its config and writes checkpoints and rank 0's result where the task reads them; "
            f"or PIPELINE_JOB_STORE=s3://bucket/prefix, where the job folder's copy lets pods share no volume")


def _resources(launch: LaunchConfig) -> k8s.V1ResourceRequirements:
    kube = launch.kubernetes
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if launch.gpus_per_node:
        requests[kube.gpu_resource] = limits[kube.gpu_resource] = str(launch.gpus_per_node)
    if launch.cpus_per_node:
        requests["cpu"] = _cpu(launch.cpus_per_node)
    if launch.memory_per_node_gb:
        requests["memory"] = _gib(launch.memory_per_node_gb)
    if kube.cpu_limit:
        limits["cpu"] = _cpu(kube.cpu_limit)
    if kube.memory_limit_gb or launch.memory_per_node_gb:
        limits["memory"] = _gib(kube.memory_limit_gb or launch.memory_per_node_gb)
    return k8s.V1ResourceRequirements(requests=requests or None, limits=limits or None)


def _mounts(kube: KubernetesConfig) -> list[k8s.V1VolumeMount]:
    mounts = [k8s.V1VolumeMount(name=SHM_VOLUME, mount_path="/dev/shm")]
    for i, item in enumerate(kube.volumes):
        mounts.append(k8s.V1VolumeMount(name=f"data-{i}", mount_path=_volume(item)[1]))
    return mounts


def _volumes(kube: KubernetesConfig) -> list[k8s.V1Volume]:
    volumes = [k8s.V1Volume(name=SHM_VOLUME, empty_dir=k8s.V1EmptyDirVolumeSource(
        medium="Memory", size_limit=_gib(kube.shm_size_gb)))]
    for i, item in enumerate(kube.volumes):
        claim, _ = _volume(item)
        volumes.append(k8s.V1Volume(name=f"data-{i}", persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
            claim_name=claim)))
    return volumes


def _volume(item: str) -> tuple[str, str]:
    claim, sep, path = item.partition(":")
    if not (sep and claim and path.startswith("/")):
        raise ConfigError(f"launch.kubernetes.volumes item {item!r}: expected CLAIM:/MOUNT/PATH")
    return claim, path


def _pair(item: str, where: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not (sep and key):
        raise ConfigError(f"{where} item {item!r}: expected KEY=VALUE")
    return key, value


def _toleration(item: str) -> k8s.V1Toleration:
    where = "launch.kubernetes.tolerations"
    head, sep, effect = item.rpartition(":")
    if not sep or effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
        raise ConfigError(f"{where} item {item!r}: expected KEY=VALUE:EFFECT or KEY:EFFECT, "
                          f"EFFECT one of NoSchedule, PreferNoSchedule, NoExecute")
    if "=" in head:
        key, value = _pair(head, where)
        return k8s.V1Toleration(key=key, operator="Equal", value=value, effect=effect)
    return k8s.V1Toleration(key=head, operator="Exists", effect=effect)


def _affinity(text: str) -> k8s.V1Affinity | None:
    if not text:
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"launch.kubernetes.affinity={text!r}: expected JSON ({exc})") from exc
    if not isinstance(raw, dict) or not set(raw) <= {"nodeAffinity", "podAffinity", "podAntiAffinity"}:
        raise ConfigError(f"launch.kubernetes.affinity={text!r}: expected an object with nodeAffinity, "
                          f"podAffinity and/or podAntiAffinity (the Kubernetes API's V1Affinity)")
    return deserialize(raw, "V1Affinity")


def deserialize(raw: Any, model: str) -> Any:
    """A client model from its API JSON (what the API server would accept), through the client's own code."""
    api = k8s.ApiClient()

    class _Response:
        data = json.dumps(raw)

    return api.deserialize(_Response(), model)


def serialize(obj: Any) -> dict:
    """The API JSON of a client model (camelCase keys, None left out)."""
    return k8s.ApiClient().sanitize_for_serialization(obj)


def _cpu(cores: float) -> str:
    return str(int(cores)) if float(cores).is_integer() else f"{int(round(cores * 1000))}m"


def _gib(gb: float) -> str:
    return f"{int(gb)}Gi" if float(gb).is_integer() else f"{int(round(gb * 1024))}Mi"
