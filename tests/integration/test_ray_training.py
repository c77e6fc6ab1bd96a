"""Ray Train on a real two-node Ray cluster: a head on this machine's network and a worker node in a network
namespace of its own, joined by a veth pair, each node with one CPU, so that the two Ray Train workers run on
different nodes and meet over the veth. The cluster is started and stopped by process id (never ``ray
stop``); after it, nothing of Ray may be left: processes, listening sockets, ``/dev/shm`` entries.

The recipe is the tabular MLP's tiny config on the demo Parquet, read by the MDS reader, so that a run on Ray
can be compared with a torchrun run of the same seed parameter for parameter.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline import stages
from pipeline.job.ray.cluster import LocalCluster
from pipeline.job.spec import JobSpec, launch_config
from pipeline.job.supervisor import Job
from pipeline.recipes import tabular_mlp
from tests.faults import sigkill_rank, when_checkpoint
from tests.jobs import run_torchrun
from tests.netns import NetworkNamespace
from tests.ray_cluster import WorkerNode, ray_processes, wait_for_nodes
from tests.streaming_shm import paths_in_use, registration_lock_path

pytestmark = [pytest.mark.distributed, pytest.mark.ray]

HEAD_IP, WORKER_IP = "10.231.9.1", "10.231.9.2"
CHECKPOINT_EVERY = 10


def _listening(pids: set[int] | None = None) -> set[tuple[str, int]]:
    """Listening sockets (of the processes ``pids``, when given)."""
    return {(c.laddr.ip, c.laddr.port) for c in psutil.net_connections("inet")
            if c.status == psutil.CONN_LISTEN and (pids is None or c.pid in pids)}


def _shm() -> set[str]:
    # streaming's own segments (NNNNNN_*) belong to the ranks, which the next launch cleans up; so does the lock
    # that the ranks of jobs on a machine register them under
    return {name for name in os.listdir("/dev/shm")
            if not re.match(r"\d{6}_", name) and name != registration_lock_path().name}


def _held_by_other_lanes() -> set[str]:
    """/dev/shm entries that processes outside this test process's tree hold: another lane's, when make test
    runs lanes side by side (a browser's, an MLflow server's). Ray's processes are gone when this is asked."""
    me = psutil.Process()
    ours = {me.pid, *(child.pid for child in me.children(recursive=True))}
    held = paths_in_use(p.pid for p in psutil.process_iter() if p.pid not in ours)
    return {Path(path).relative_to("/dev/shm").parts[0] for path in held}


@pytest.fixture(scope="module")
def nodes():
    """A head (1 CPU) and a worker node (1 CPU) in its own network namespace; afterwards nothing of Ray left."""
    before = (set(ray_processes()), _shm())
    ray_ports: set = set()
    namespace = NetworkNamespace(f"rayw{os.getpid() % 10000}", HEAD_IP, WORKER_IP)
    if not namespace.create():
        pytest.skip("network namespaces need root and iproute2 (apt-get install -y iproute2)")
    # Gloo finds a rank's address from its host name, the same (loopback) on both "nodes" here: each node's
    # ranks are told their interface, as on any machine with more than one network.
    head = LocalCluster(cpus=1, grace_period_s=5, node_ip=HEAD_IP, env={"GLOO_SOCKET_IFNAME": namespace.host_dev})
    worker = None
    try:
        head.start(print)
        worker = WorkerNode(head.gcs_address, node_ip=WORKER_IP, cpus=1, wrap=namespace.wrap(),
                            env={"GLOO_SOCKET_IFNAME": namespace.dev})
        wait_for_nodes(head.address, 2)
        yield head.address, worker
        ray_ports = _listening({int(p.split(":")[0]) for p in set(ray_processes()) - before[0]})
    finally:
        if worker is not None:
            worker.stop()
        head.stop()
        namespace.remove()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and set(ray_processes()) - before[0]:
        time.sleep(0.5)
    assert set(ray_processes()) - before[0] == set(), "Ray processes outlived the cluster"
    assert ray_ports and ray_ports & _listening() == set(), "Ray's sockets still listening after the cluster stopped"
    assert _shm() - before[1] - _held_by_other_lanes() == set(), "/dev/shm entries left by Ray"


@pytest.fixture(scope="module")
def cluster(nodes) -> str:
    return nodes[0]


@pytest.fixture(scope="module")
def job(demo_parquet, tmp_path_factory):
    cfg = tabular_mlp.config("tiny").with_overrides({
        "data.input_path": str(demo_parquet), "train.epochs": 2, "train.batch_size": 32,
        "train.checkpoint_every_steps": CHECKPOINT_EVERY, "train.log_every_steps": 5,
    })
    dataset = stages.prepare_data(cfg, stages.RunInfo("ray", "prep"))
    config_path = tmp_path_factory.mktemp("ray") / "config.json"
    config_path.write_text(json.dumps(cfg.to_dict()))
    return ["-m", "pipeline.rank", "--config", str(config_path), "--dataset", dataset.uri]


@pytest.fixture(scope="module")
def torchrun_result(job, tmp_path_factory):
    out = tmp_path_factory.mktemp("torchrun")
    run_torchrun(job, job_dir=out, nproc_per_node=2, emit=lambda line: None)
    return json.loads((out / "result.json").read_text())


def _spec(job, address: str, out: Path, ray: dict | None = None, **launch) -> JobSpec:
    options = {"kind": "ray", "nproc_per_node": 2, "grace_period_s": 3, "max_restarts": 1, **launch,
               "ray": {"address": address, "python": sys.executable, "cpus_per_worker": 1, **(ray or {})}}
    return JobSpec(entry=job, job_dir=out, launch=launch_config(options), name="raytest",
                   labels={"dag_id": "ray", "run_id": out.name, "task_id": "train", "try_number": "1"})


@pytest.fixture(scope="module")
def ray_run(cluster, job, tmp_path_factory):
    """An uninterrupted run on the two nodes: its lines and result."""
    lines: list[str] = []
    result = Job(_spec(job, cluster, tmp_path_factory.mktemp("ray-run") / "out")).run(lines.append)
    return lines, result


def test_training_across_two_nodes_matches_torchrun_with_the_same_seed(ray_run, torchrun_result):
    lines, result = ray_run
    placed = " ".join(line for line in lines if "world_rank=" in line)
    assert f"ip={HEAD_IP}" in placed and f"ip={WORKER_IP}" in placed, "the two workers did not span both nodes"
    assert any("[rank 0]: epoch 2/2 " in line for line in lines)  # rank 0's own lines, live, with its prefix
    assert result["world_size"] == torchrun_result["world_size"] == 2
    assert result["steps"] == torchrun_result["steps"]
    # Not to the bit: streaming orders an epoch by physical node (num_canonical_nodes defaults to their number),
    # so 2 nodes x 1 rank see the same samples as torchrun's 1 node x 2 ranks in another order. Both runs must
    # learn alike: the validation accuracy within five points (2 epochs of a tiny model: the order alone moves it
    # by about two), the loss within 15%. Bit-for-bit determinism on Ray is the next test's.
    ray_metrics, torchrun_metrics = result["metrics"], torchrun_result["metrics"]
    print(f"ray {ray_metrics}\ntorchrun {torchrun_metrics}")
    assert ray_metrics["val_accuracy"] == pytest.approx(torchrun_metrics["val_accuracy"], abs=0.05)
    assert ray_metrics["val_loss"] == pytest.approx(torchrun_metrics["val_loss"], rel=0.15)


def _submitted(lines: list[str]) -> list[str]:
    """The submission ids of the Ray jobs the supervisor submitted, in order."""
    return [line.split()[3] for line in lines if line.startswith("submitting Ray job ")]


def test_a_worker_killed_mid_epoch_ends_the_job_and_the_next_one_resumes_from_the_checkpoint(cluster, job, ray_run,
                                                                                            tmp_path):
    """Ray Train restarts nothing: the supervisor's restart is a new Ray job, the next attempt's."""
    out, lines, killed = tmp_path / "out", [], {}
    watcher = when_checkpoint(out, sigkill_rank(1, killed), CHECKPOINT_EVERY)
    result = Job(_spec(job, cluster, out, max_restarts=1)).run(lines.append)
    watcher.join(timeout=5)
    assert killed, "the worker was never killed"
    assert any("restarting every rank (1 of 1)" in line for line in lines)
    jobs = _submitted(lines)
    assert len(jobs) == 2 and jobs[0].endswith("-r0") and jobs[1].endswith("-r1"), jobs
    assert 0 < result["start_step"] < result["steps"]  # resumed mid-run from the job folder's checkpoint
    # The same topology as the uninterrupted run, resumed at a step with the loader's position: the same end.
    assert result["param_digests"] == ray_run[1]["param_digests"], "the resumed run ended elsewhere"


def test_fsdp_on_ray_trains_workers_killed_mid_epoch_resume_from_their_shards(cluster, job, ray_run, tmp_path):
    """FSDP2 on Ray Train's process group: a worker killed after a sharded checkpoint, the next attempt's job loads
    the shards back; the end is DDP's on the same topology (to the order of the gradient sums)."""
    out, lines, killed = tmp_path / "out", [], {}
    watcher = when_checkpoint(out, sigkill_rank(1, killed), CHECKPOINT_EVERY)
    result = Job(_spec(job + ["--set", "train.parallelism=fsdp"], cluster, out, max_restarts=1)).run(lines.append)
    watcher.join(timeout=5)
    assert killed, "the worker was never killed"
    assert result["parallelism"] == "fsdp" and 0 < result["start_step"] < result["steps"] == ray_run[1]["steps"]
    assert any((out / "checkpoints").glob("step-*/shards/.metadata"))
    assert result["metrics"] == pytest.approx(ray_run[1]["metrics"], rel=1e-3)


def test_losing_one_of_two_nodes_resumes_on_the_node_left_at_the_same_sample(nodes, job, tmp_path):
    """Elastic (launch.min_nnodes): the worker node goes away mid-epoch; the next attempt's job starts with the one
    worker that still fits and the loop resumes from the last checkpoint at the sample the two workers had reached.
    The last test of the module: the cluster has one node afterwards."""
    address, worker = nodes
    out, lines = tmp_path / "out", []
    watcher = when_checkpoint(out, lambda beats: worker.stop(), CHECKPOINT_EVERY)
    # The next job's Ray Train first tries the old size again, the lost node's CPU still counted until the head
    # declares it dead (Ray's health checks), and starts on one worker only when that start times out: 25 s here
    # instead of Ray's 60 (a worker group starts in about 7 s on this machine).
    spec = _spec(job, address, out, ray={"worker_start_timeout_s": 25}, nnodes=2, nproc_per_node=1, min_nnodes=1)
    result = Job(spec).run(lines.append)
    watcher.join(timeout=5)
    assert not worker.alive()
    assert result["world_size"] == 1
    resumed = next(line for line in lines if "resuming from checkpoint" in line and "on 1 rank" in line)
    epoch, done, per_epoch = map(int, re.search(r"epoch (\d+) at its step (\d+) of (\d+) on 1 rank", resumed).groups())
    two_ranks = int(re.search(r"(\d+) steps/epoch", next(line for line in lines if "on 2 rank(s)" in line)).group(1))
    # The checkpoint was written by 2 ranks, step start_step, that many steps into its epoch; on 1 rank a step
    # takes half the samples: the epoch resumes twice as many steps in, at the same sample, and runs to its end.
    assert 0 < done < per_epoch
    assert done == 2 * (result["start_step"] - (epoch - 1) * two_ranks)
    assert result["steps"] == result["start_step"] + (per_epoch - done) + per_epoch * (2 - epoch)
    assert any("checkpoint written by 2 ranks, resuming on 1" in line for line in lines)
