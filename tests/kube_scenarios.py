"""What the stand-in cluster (``tests/kube_standin.py``) does with each Job created: its *scenarios*. Each makes
the Job's pods and moves them through their phases, writes their log lines, and may write into the shared job
folder what the ranks would (rank 0's result, a user error). None waits for time to pass: each goes on once the
client has seen its last move."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from tests.kube_standin import StandinCluster


def nodes_run(cluster: StandinCluster, job: dict, *, lines: int = 3, fail_node: int | None = None,
              user_error: bool = False, forever: bool = False, result: dict | None = None,
              on_success: Callable[[dict], None] | None = None, stalled: bool = False,
              autoscaled_away: bool = False, preempt_first: bool = False) -> None:
    """Every pod schedules (the client sees them pending first) and runs; node k logs ``step i`` lines, both nodes
    at once (a node writes its next line only once the client was sent the other's previous one); then all succeed
    (rank 0 writes its result), ``fail_node`` fails (optionally reporting a user error first), or (``forever``)
    they run until deleted. ``preempt_first``: the first attempt's pods are evicted (the ranks checkpoint, mark the
    preemption and exit with its code); a later attempt runs to the end."""
    listed = cluster.lists()
    pods = cluster.make_pods(job)
    cluster.seen(job, listed)
    if autoscaled_away:  # pod 1's node is scaled down as it finishes: the pod was listed, its log is gone
        with cluster.lock:
            cluster.logs.pop(pods[1], None)
    with cluster.lock:
        asked = cluster.requests.count(("get", "pods/log"))
    for key in pods:
        cluster.set_pod(key, "Running")
    # Every pod's log asked for (the one that is gone answers 404), the others' streams open.
    cluster.until(job, lambda: cluster.requests.count(("get", "pods/log")) >= asked + len(pods)
                  and cluster.open_streams >= len(pods) - (1 if autoscaled_away else 0))
    env = cluster.pod_env(job)
    if stalled:  # rank 0 reports step 5 once, then no step completes
        progress = Path(env["PIPELINE_PROGRESS_DIR"])
        progress.mkdir(parents=True, exist_ok=True)
        (progress / "rank-0.json").write_text(json.dumps({"rank": 0, "pid": 1, "step": 5, "total": 100, "epoch": 0,
                                                          "phase": "training", "time": time.time()}))
    for step in range(lines):
        if not cluster.alive(job):
            return
        for node, key in enumerate(pods):
            cluster.log(key, f"[rank {node}] step {step}")
        cluster.logged(job, pods, step + 1)
    if forever:  # the ranks run on, quietly, until the Job is deleted
        cluster.until(job, timeout_s=600)
    if not cluster.alive(job):
        return
    if preempt_first and job["metadata"]["name"].endswith("-r0"):
        from pipeline.job_files import PREEMPTED_EXIT_CODE, mark_preempted

        mark_preempted(Path(env["PIPELINE_PROGRESS_DIR"]), rank=0, step=7)
        listed = cluster.lists()
        for key in pods:
            cluster.log(key, "SIGTERM: checkpointed at step 7")
            cluster.set_pod(key, "Failed", exit_code=PREEMPTED_EXIT_CODE, message="preempted at step 7")
        cluster.seen(job, listed)  # the pods' phases first, then the Job's condition
        cluster.end_job(job, "Failed", "PodFailurePolicy", "a pod was evicted")
        return
    if fail_node is not None:
        if user_error:
            errors = Path(env["PIPELINE_ERROR_DIR"])
            errors.mkdir(parents=True, exist_ok=True)
            rank = fail_node * int(env["PET_NPROC_PER_NODE"])
            (errors / f"rank-{rank}.json").write_text(json.dumps(
                {"rank": rank, "type": "DataError", "message": "shard 3, row 17: label 'x' is not a class"}))
        listed = cluster.lists()
        cluster.log(pods[fail_node], "Traceback (most recent call last):\nRuntimeError: boom")
        cluster.set_pod(pods[fail_node], "Failed", exit_code=1, message="RuntimeError: boom")
        cluster.seen(job, listed)  # the pod's failure first, then the Job's condition
        cluster.end_job(job, "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")
        return
    Path(env["PIPELINE_RESULT_FILE"]).write_text(json.dumps(result or {
        "final_loss": 0.25, "nodes": len(pods), "restart": int(env["PIPELINE_RESTART_COUNT"])}))
    if on_success is not None:
        on_success(job)
    for key in pods:
        cluster.set_pod(key, "Succeeded")
    cluster.end_job(job, "Complete", "", "")


def unschedulable(cluster: StandinCluster, job: dict) -> None:
    for key in cluster.make_pods(job):
        cluster.set_pod(key, "Pending", unschedulable="0/4 nodes are available: 4 Insufficient nvidia.com/gpu.")


def image_pull_backoff(cluster: StandinCluster, job: dict) -> None:
    pods = cluster.make_pods(job)
    cluster.set_pod(pods[0], "Running")
    image = job["spec"]["template"]["spec"]["containers"][0]["image"]
    cluster.set_pod(pods[1], "Pending", waiting=("ImagePullBackOff", f'Back-off pulling image "{image}"'))


def crash_before_start(cluster: StandinCluster, job: dict) -> None:
    pods = cluster.make_pods(job)
    cluster.set_pod(pods[0], "Pending", waiting=("ContainerCreating", ""))
    cluster.set_pod(pods[1], "Failed", exit_code=127, message="exec: python: not found")
