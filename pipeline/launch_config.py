"""Where a run trains, the config's ``launch`` section: the place (``launch.kind``: local torchrun, Kubernetes,
Ray), its ranks and its fault handling. Not part of what is trained (every field a ``where_field``): a run moved to
another place or number of ranks keeps its digest and resumes from its checkpoints."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config_fields import where_field
from pipeline.errors import ConfigError


@dataclass(kw_only=True)
class KubernetesConfig:
    """``launch.kind = kubernetes``: an indexed Job of ``launch.nnodes`` pods, each running torchrun with
    ``launch.nproc_per_node`` ranks, and a headless Service for pod 0's DNS name (pipeline.job.kubernetes.place).
    GPUs, CPUs and memory per pod are ``launch.gpus_per_node``, ``cpus_per_node`` and ``memory_per_node_gb``."""

    image: str = where_field("ddp-pipelines:latest", "Container image of every pod (the project's Dockerfile).")
    image_pull_policy: str = where_field("IfNotPresent", "When the kubelet pulls the image.",
                                         choices=["IfNotPresent", "Always", "Never"])
    image_pull_secrets: list[str] = where_field([], "Secrets holding registry credentials for the image.")
    namespace: str = where_field("default", "Namespace of the Job, its pods and its Service.")
    connection_id: str = where_field(
        "kubernetes_default", "Airflow connection of the cluster (the Kubernetes provider's); without one, the "
        "in-cluster service account or ~/.kube/config.")
    service_account: str = where_field("", "Service account of the pods; empty: the namespace's default.")
    gpu_resource: str = where_field("nvidia.com/gpu", "Extended resource name of a GPU (requests = limits = launch.gpus_per_node).")
    cpu_limit: float = where_field(0.0, "CPU cores a pod may use at most; 0: no limit.", min=0.0)
    memory_limit_gb: float = where_field(0.0, "Memory a pod may use at most, in GiB; 0: the request (launch.memory_per_node_gb).", min=0.0)
    shm_size_gb: float = where_field(
        16.0, "Size of /dev/shm, a memory-backed emptyDir (data loader workers and NCCL need more than 64 MiB).",
        min=0.0625, max=4096.0)
    node_selector: list[str] = where_field([], "KEY=VALUE labels a node must have.")
    tolerations: list[str] = where_field(
        [], "Taints the pods tolerate: KEY=VALUE:EFFECT, or KEY:EFFECT for any value (nvidia.com/gpu:NoSchedule).")
    affinity: str = where_field("", "Pod affinity as JSON in the Kubernetes API's form (V1Affinity); empty: none.")
    priority_class: str = where_field("", "PriorityClass of the pods; empty: the cluster's default.")
    volumes: list[str] = where_field(
        [], "PersistentVolumeClaims mounted in every pod as CLAIM:MOUNT_PATH. The job folder (PIPELINE_HOME's runs) "
        "and local datasets must lie on one, mounted at the same path in the Airflow workers; object-store "
        "datasets (s3://, gs://) need none.")
    env_from_secrets: list[str] = where_field(
        [], "Secrets whose keys become environment variables of the ranks (MLflow or object-store credentials); "
        "their values never appear in the manifest.")
    run_as_user: int = where_field(50000, "User id the containers run as (the image's non-root user).", min=1)
    master_port: int = where_field(29500, "Port of the c10d rendezvous on pod 0.", min=1024, max=65535)
    schedule_timeout_s: float = where_field(
        600.0, "Every pod must be running this long after the Job is created, or the attempt fails naming why "
        "(unschedulable, image pull, crash loop).", min=1.0)
    ttl_after_finished_s: int = where_field(
        300, "ttlSecondsAfterFinished: the cluster deletes a finished Job that the supervisor could not.", min=0)
    queue_name: str = where_field(
        "", "Kueue LocalQueue: the Job is created suspended and Kueue admits every pod at once; empty: no Kueue.")
    deferrable: bool = where_field(
        False, "TorchrunOperator and @task.torchrun wait in the triggerer while the pods run instead of "
        "holding a worker slot.")


@dataclass(kw_only=True)
class RayConfig:
    """``launch.kind = ray``: one Ray job per attempt, submitted through the Ray Jobs API; its driver runs Ray
    Train's ``TorchTrainer`` with ``launch.nnodes x launch.nproc_per_node`` workers, each running the same
    entry as a torchrun rank (pipeline.job.ray)."""

    address: str = where_field(
        "", "Ray dashboard address of a running cluster (http://HOST:8265); empty: the connection's host, and "
        "without one a local cluster started for the task on 127.0.0.1 and stopped with it.")
    connection_id: str = where_field(
        "ray_default", "Airflow connection of the cluster: host and port give the address, the password (or "
        "extra token) is sent as a bearer token (Ray's token authentication).")
    python: str = where_field(
        "", "Interpreter of the job's driver on the cluster (the project installed beside Ray); empty: python on "
        "a cluster's PATH, this interpreter for a local cluster.")
    cpus_per_worker: float = where_field(
        1.0, "CPUs each training worker reserves; fractional values leave CPUs to Ray Data on small nodes.",
        min=0.0, max=1024.0)
    local_cpus: int = where_field(0, "CPUs of the local cluster; 0: this machine's.", min=0, max=4096)
    start_timeout_s: float = where_field(
        600.0, "The job must be running this long after its submission, or the attempt fails as not started.",
        min=1.0)
    worker_start_timeout_s: float = where_field(
        60.0, "How long Ray Train waits for every worker of a worker group to start "
        "(RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, Ray's default 60). An elastic job that has just lost a node first "
        "tries its old size again, the lost node's CPUs still counted until Ray declares it dead, and restarts on "
        "the workers that fit only after this.", min=1.0)
    deferrable: bool = where_field(
        False, "TorchrunOperator and @task.torchrun wait in the triggerer while the job runs instead of holding "
        "a worker slot (needs launch.ray.address or the connection: a local cluster lives in the task).")


@dataclass(kw_only=True)
class LaunchConfig:
    """Where and how the ranks run: one definition for the pipeline's train stage, ``TorchrunOperator``
    and ``@task.torchrun`` (their keyword arguments are these fields)."""

    kind: str = where_field(
        "local", "Where the job runs (its place): local runs torchrun as processes of this worker; kubernetes runs one pod per node "
        "(launch.kubernetes.*); ray runs Ray Train workers on a Ray cluster (launch.ray.*).",
        choices=["local", "kubernetes", "ray"],
    )
    nnodes: int = where_field(1, "Nodes (machines) of the job; with the local place, more than one needs rdzv_endpoint.", min=1, max=1024)
    min_nnodes: int = where_field(
        0, "Elastic: the fewest nodes an attempt starts or restarts with (after losing a node, training resumes "
        "from its last checkpoint on the nodes left, at the same sample); 0: exactly nnodes. torchrun "
        "--nnodes=MIN:MAX on the local place; on Ray, MIN x nproc_per_node to nnodes x nproc_per_node workers.",
        min=0, max=1024)
    nproc_per_node: int = where_field(2, "Training processes (ranks) on each node.", min=1, max=64)
    node_rank: int = where_field(0, "This node's rank when the local place joins a multi-node job.", min=0)
    rdzv_endpoint: str = where_field("", "HOST:PORT of the c10d rendezvous of a multi-node job; empty for one node.")
    gpus_per_node: int = where_field(
        0, "GPUs each node must have (one per rank is usual); 0 runs on whatever the node has, CPU included.",
        min=0, max=64,
    )
    cpus_per_node: float = where_field(0.0, "CPU cores each node asks for (where the place schedules); 0: no request.", min=0.0)
    memory_per_node_gb: float = where_field(0.0, "Memory each node asks for, in GiB (where the place schedules); 0: no request.", min=0.0)
    backend: str = where_field(
        "auto", "Process-group backend; auto picks nccl with a GPU, gloo without.",
        choices=["auto", "gloo", "nccl"],
    )
    timeout_s: int = where_field(24 * 3600, "Longest a training job may run before it is stopped.", min=1)
    grace_period_s: float = where_field(10.0, "Seconds between SIGTERM and SIGKILL when stopping ranks.", min=0.0)
    max_restarts: int = where_field(
        0, "Times torchrun restarts all ranks after one fails; they resume from the last checkpoint.", min=0, max=100,
    )
    stall_timeout_s: float = where_field(
        600.0, "Stop the job and fail the attempt (retryable) when no training step completes for this "
        "long; 0 disables the watchdog.", min=0.0,
    )
    straggler_ratio: float = where_field(
        1.3, "A rank whose compute time per step is above this many times the median of the other ranks' is a "
        "straggler (named in the task log and on the MLflow run).", min=1.0)
    straggler_windows: int = where_field(
        3, "Windows of train.log_every_steps steps in a row a rank must be above launch.straggler_ratio to be "
        "named a straggler.", min=1, max=1000)
    price_per_gpu_hour: float = where_field(
        0.0, "What one GPU costs per hour (any currency): each attempt's GPU-hours are priced with it.", min=0.0)
    price_per_node_hour: float = where_field(
        0.0, "What one node costs per hour besides its GPUs (a CPU node's whole price).", min=0.0)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        # The rules between fields, checked once here: a place is never handed settings it cannot run.
        if self.min_nnodes > self.nnodes:
            raise ConfigError(f"launch.min_nnodes={self.min_nnodes}: expected at most launch.nnodes={self.nnodes} "
                              f"(0 for a job of exactly nnodes nodes)")
        if self.kind == "local" and self.nnodes > 1 and not self.rdzv_endpoint:
            raise ConfigError(f"launch.nnodes={self.nnodes} with the local place needs launch.rdzv_endpoint "
                              f"(HOST:PORT of the c10d rendezvous that every node's torchrun agent joins)")

    @property
    def deferrable(self) -> bool:
        """Whether the place of ``kind`` waits in Airflow's triggerer (its section's ``deferrable``)."""
        return bool(getattr(getattr(self, self.kind, None), "deferrable", False))
