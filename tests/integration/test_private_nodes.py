"""A two-node training job whose nodes share no folder: the recipe's real train job on the Kubernetes place,
supervised as the train task does (``Job``), with its data, its job folder's copy and its checkpoints on an S3 API
server (moto's) and no volume in its pods.

No cluster runs here: the stand-in API server plays the cluster, and its scenario runs each pod's rendered command
(the mirror's agent around torchrun, ``pipeline.job.mirror``) and environment (plus what the pods' Kubernetes
Secret would add: the store's endpoint and keys) as a real process, in a network namespace of its own (the pods on
one bridge, the S3 server reached at the bridge's address) and a mount namespace in which the session's home (the
runs folder, the supervisor's job folder), pytest's temporary folders (the test's) and ``/dev/shm`` are empty tmpfs
of its own, and its ``TMPDIR`` and ``HOME`` a tmpfs folder of its own. The checkout and its interpreter stay visible
wherever they are (a clone under /tmp included). So the config reaches the ranks, and heartbeats, metrics,
checkpoints and the result reach the supervisor, through the bucket only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import pytest

from pipeline import deployment, stages, storage
from pipeline.job.kubernetes import place as kube
from pipeline.job.kubernetes.manifest import Manifests, deserialize
from pipeline.recipes import tabular_mlp
from pipeline.train.checkpoint import CheckpointStore
from tests.kube_standin import StandinCluster, rendered_pod
from tests.netns import PodNetwork
from tests.outage import Relay

pytestmark = pytest.mark.distributed

CONN = "k8s_private_nodes"


@pytest.fixture
def unseen(pipeline_home, tmp_path_factory) -> list[str]:
    """The folders of this machine that no node sees: the session's home (runs, job folders, data) and pytest's
    temporary folders (the test's own). Not /tmp as a whole: a checkout there, and its interpreter, would go too."""
    return [str(pipeline_home), str(tmp_path_factory.getbasetemp())]


def _pods_run_privately(network: PodNetwork, secret_env: dict[str, str], outputs: dict[str, list[str]],
                        unseen: list[str], node_dirs: list[Path]):
    """The cluster's part: each pod of a Job runs its rendered command as a process in its namespaces; its lines
    are its log, its exit code its phase; the Job completes when every pod succeeded. Each pod's ``TMPDIR`` and
    ``HOME`` are a folder of ``node_dirs``, a tmpfs of its own inside the pod."""

    def scenario(cluster: StandinCluster, job: dict) -> None:
        keys = cluster.make_pods(job)
        manifests = Manifests(job=deserialize(job, "V1Job"), service=None)
        name = job["metadata"]["name"]  # the headless Service's name too: pod i is NAME-i.NAME
        network.set_hosts({i: [f"{name}-{i}.{name}", f"{name}-{i}"] for i in range(len(keys))})
        processes = []
        for index, key in enumerate(keys):
            command, env = rendered_pod(manifests, index)
            assert command[0] == "python"  # the image's interpreter; this machine's here
            image_path = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])  # its python first
            hostname = f"{name}-{index}"
            node_dir = Path(tempfile.mkdtemp(prefix=f"{hostname}-"))
            node_dirs.append(node_dir)
            env = {"PATH": image_path, "HOME": str(node_dir), "TMPDIR": str(node_dir), "LANG": "C.UTF-8", **env,
                   **secret_env}
            argv = network.wrap(index, hostname, [*unseen, str(node_dir)], [sys.executable, *command[1:]])
            processes.append(subprocess.Popen(argv, env=env, cwd=deployment.PROJECT_ROOT, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True))
            cluster.set_pod(key, "Running")
            outputs[key] = []

        def relay_log(key, process) -> None:
            for line in process.stdout:
                outputs[key].append(line.rstrip("\n"))
                cluster.log(key, line.rstrip("\n"))

        readers = [threading.Thread(target=relay_log, args=(k, p), daemon=True) for k, p in zip(keys, processes)]
        for reader in readers:
            reader.start()
        try:
            while cluster.alive(job) and any(p.poll() is None for p in processes):
                cluster.wait_for(lambda: not cluster.alive(job), 0.5)
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                process.wait()
            for reader in readers:
                reader.join(timeout=5)
        codes = [p.returncode for p in processes]
        for key, code in zip(keys, codes):
            cluster.set_pod(key, "Succeeded" if code == 0 else "Failed", exit_code=code)
        if cluster.alive(job):
            failed = any(codes)
            cluster.end_job(job, "Failed" if failed else "Complete", "BackoffLimitExceeded" if failed else "", "")

    return scenario


@pytest.fixture
def pod_network():
    if os.geteuid() != 0:
        pytest.skip("private mounts and network namespaces need root")
    network = PodNetwork(uuid.uuid4().hex[:6])
    if not network.create():
        pytest.skip("network namespaces could not be created here (iproute2, CAP_NET_ADMIN)")
    yield network
    network.remove()


def _kill_node_once_checkpointed(network: PodNetwork, node: int, checkpoints: str, killed: list,
                                 done: threading.Event) -> threading.Thread:
    """SIGKILL every process of pod ``node`` once a complete checkpoint is on the bucket (as a node lost); it gives up
    once ``done`` is set, before the test ends. It reads the bucket with the test's environment and never changes it:
    a thread that sets and restores variables, outliving its test, can take a later test's credentials away."""
    import signal

    def watch() -> None:
        while not done.wait(0.3):
            steps = [step for step, _ in CheckpointStore(checkpoints).complete()]
            pids = subprocess.run(["ip", "netns", "pids", network.names[node]], capture_output=True,
                                  text=True).stdout.split()
            if steps and pids:
                for pid in pids:
                    os.kill(int(pid), signal.SIGKILL)
                killed.append(max(steps))
                return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("lose_a_node", [False, True], ids=["whole", "node-lost"])
def test_a_two_node_job_whose_nodes_share_no_folder_trains_through_the_bucket(s3_server, s3, pod_network, unseen,
                                                                               demo_parquet, monkeypatch, tmp_path,
                                                                               lose_a_node):
    from pipeline.job.supervisor import Job
    from pipeline.airflow.connections import AirflowClusters

    monkeypatch.setattr(kube, "POLL_S", 0.2)
    monkeypatch.setattr(kube.KubernetesPlace, "poll_s", 0.2)
    monkeypatch.setenv("PIPELINE_DATA_DIR", f"{s3}/datasets")
    monkeypatch.setenv("PIPELINE_JOB_STORE", f"{s3}/jobs")
    monkeypatch.setenv("PIPELINE_STAGING_DIR", str(tmp_path / "staging"))
    relay = Relay(s3_server.port, host=pod_network.host_ip)  # the store, as the pods reach it
    secret_env = s3_server.env() | {"AWS_ENDPOINT_URL": relay.endpoint}
    outputs: dict[str, list[str]] = {}
    node_dirs: list[Path] = []
    cluster = StandinCluster(_pods_run_privately(pod_network, secret_env, outputs, unseen, node_dirs)).__enter__()
    watcher, done = None, threading.Event()
    for key, value in cluster.connection_env(CONN).items():
        monkeypatch.setenv(key, value)
    try:
        cfg = tabular_mlp.config("tiny").with_overrides({
            "data.input_path": str(demo_parquet), "train.epochs": 2, "train.batch_size": 32,
            "train.checkpoint_every_steps": 20, "train.log_every_steps": 5,
            "launch.kind": "kubernetes", "launch.nnodes": 2, "launch.nproc_per_node": 1, "launch.backend": "gloo",
            "launch.grace_period_s": 3, "launch.kubernetes.connection_id": CONN,
            "launch.kubernetes.schedule_timeout_s": 60, "launch.max_restarts": 1 if lose_a_node else 0})
        run = stages.RunInfo("private_nodes", f"run-{uuid.uuid4().hex[:6]}")
        dataset = stages.prepare_data(cfg, run)
        assert dataset.uri.startswith(f"{s3}/datasets/")
        spec = stages.train_job(cfg, run, dataset)
        store = f"{s3}/jobs/{deployment.job_key(spec.files.root)}"
        killed: list[int] = []
        if lose_a_node:
            watcher = _kill_node_once_checkpointed(pod_network, 1, f"{store}/checkpoints", killed, done)
        lines: list[str] = []
        result = Job(spec, clusters=AirflowClusters(), metrics_flush_timeout_s=30).run(lines.append)
    finally:
        done.set()
        if watcher is not None:
            watcher.join(timeout=60)
        cluster.__exit__()
        relay.down()
        left_on_host = {str(d): [p.name for p in d.iterdir()] for d in node_dirs}
        for node_dir in node_dirs:
            shutil.rmtree(node_dir, ignore_errors=True)
    everything = "\n".join(lines) + "\n" + "\n".join(line for out in outputs.values() for line in out)
    assert result is not None, everything[-4000:]
    files = spec.files
    pod = cluster.created_jobs[-1]["spec"]["template"]["spec"]
    assert not any(v.get("persistentVolumeClaim") for v in pod["volumes"])  # no volume shared by the pods

    # The result, the heartbeats of both ranks and rank 0's metrics reached the supervisor's folder from the bucket.
    assert result["world_size"] == 2 and result["steps"] > 0
    assert json.loads(files.result.read_text()) == {k: v for k, v in result.items() if k != "unsent_metrics"}
    assert sorted(p.name for p in files.progress.glob("rank-*.json")) == ["rank-0.json", "rank-1.json"]
    assert any("step_loss" in line for line in files.metrics.read_text().splitlines())
    assert "config.json" in storage.sizes(f"{store}/in")
    if lose_a_node:  # the second attempt's pods resumed from the newest checkpoint on the bucket
        assert killed and len(cluster.created_jobs) == 2
        assert result["start_step"] >= killed[0] > 0
        assert result["resumed_from"].startswith(f"{store}/checkpoints/step-")
    else:
        assert len(cluster.created_jobs) == 1 and result["start_step"] == 0
    # What the pods wrote in their own folders never appeared in this one: torchrun's logs stayed in the pods, and
    # their TMPDIR (the staging of checkpoints, torchrun's files) was a tmpfs over the folder made for them here.
    assert not list(files.root.glob("logs-try*/torchrun-*/node-*"))
    assert node_dirs and not any(left_on_host.values()), left_on_host
    # The checkpoints are on the bucket, under the job's copy: complete ones, none in the job folder.
    saved = CheckpointStore(f"{store}/checkpoints").complete()
    assert saved and saved[0][0] == result["steps"]
    assert not files.checkpoints.exists()
    # Both nodes ran their ranks on hosts of their own.
    assert {json.loads((files.progress / f"rank-{r}.json").read_text())["host"] for r in (0, 1)} == {
        f"{cluster.created_jobs[-1]['metadata']['name']}-{i}" for i in (0, 1)}


@pytest.mark.ray
def test_a_ray_job_whose_worker_node_shares_no_folder_trains_through_the_bucket(s3_server, s3, demo_parquet, unseen,
                                                                                monkeypatch, tmp_path):
    """A Ray head on this machine and a worker node in a network namespace to which the runs folder and the test's
    folders are empty tmpfs, and whose Ray session folder and TMPDIR are a tmpfs of its own, one Ray Train worker on
    each: the worker there fetches the config from the job folder's copy and pushes its files there; Ray Train's
    storage path and the checkpoints are on the bucket."""
    from pipeline.job.ray.cluster import LocalCluster
    from pipeline.job.supervisor import Job
    from tests.netns import NetworkNamespace
    from tests.ray_cluster import WorkerNode, wait_for_nodes

    if os.geteuid() != 0:
        pytest.skip("private mounts and network namespaces need root")
    head_ip, worker_ip = "10.231.12.1", "10.231.12.2"
    namespace = NetworkNamespace(f"rayp{os.getpid() % 10000}", head_ip, worker_ip)
    if not namespace.create():
        pytest.skip("network namespaces could not be created here (iproute2, CAP_NET_ADMIN)")
    relay = Relay(s3_server.port, host=head_ip)  # the store, as both nodes reach it
    monkeypatch.setenv("AWS_ENDPOINT_URL", relay.endpoint)
    monkeypatch.setenv("PIPELINE_DATA_DIR", f"{s3}/datasets")
    monkeypatch.setenv("PIPELINE_JOB_STORE", f"{s3}/jobs")
    monkeypatch.setenv("PIPELINE_STAGING_DIR", str(tmp_path / "staging"))
    head = LocalCluster(cpus=1, grace_period_s=5, node_ip=head_ip, env={"GLOO_SOCKET_IFNAME": namespace.host_dev})
    worker = None
    try:
        head.start(print)
        node_dir = Path(tempfile.mkdtemp(prefix="raywk-", dir="/tmp"))  # short: Ray's socket paths are in it
        worker = WorkerNode(head.gcs_address, node_ip=worker_ip, cpus=1, temp_dir=node_dir,
                            wrap=namespace.wrap(private=[*unseen, str(node_dir)]),
                            env={"GLOO_SOCKET_IFNAME": namespace.dev, "TMPDIR": str(node_dir)})
        wait_for_nodes(head.address, 2)
        cfg = tabular_mlp.config("tiny").with_overrides({
            "data.input_path": str(demo_parquet), "train.epochs": 2, "train.batch_size": 32,
            "train.checkpoint_every_steps": 20, "train.log_every_steps": 5,
            "launch.kind": "ray", "launch.nproc_per_node": 2, "launch.grace_period_s": 3,
            "launch.ray.address": head.address, "launch.ray.python": sys.executable, "launch.ray.cpus_per_worker": 1})
        run = stages.RunInfo("private_ray", f"run-{uuid.uuid4().hex[:6]}")
        dataset = stages.prepare_data(cfg, run)
        spec = stages.train_job(cfg, run, dataset)
        lines: list[str] = []
        result = Job(spec, metrics_flush_timeout_s=30).run(lines.append)
        session_files = [p.name for p in worker.temp_dir.iterdir()]
    finally:
        if worker is not None:
            worker.stop()
        head.stop()
        namespace.remove()
        relay.down()
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    assert result is not None and result["world_size"] == 2, "\n".join(lines[-60:])
    store = f"{s3}/jobs/{deployment.job_key(spec.files.root)}"
    pushed = storage.sizes(f"{store}/nodes")
    assert {"0/progress/rank-0.json", "1/progress/rank-1.json", "0/result.json"} <= set(pushed)
    assert "config.json" in storage.sizes(f"{store}/in")
    saved = CheckpointStore(f"{store}/checkpoints").complete()
    assert saved and saved[0][0] == result["steps"]
    assert storage.sizes(f"{store}/ray"), "Ray Train's storage path is on the bucket"
    assert not spec.files.checkpoints.exists()
    # The worker node's folder was its own: its Ray session is not in the folder this machine made for it.
    assert session_files == ["node.log"], session_files
