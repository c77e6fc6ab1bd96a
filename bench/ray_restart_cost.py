"""What a restart costs on Ray: from a Ray Train worker SIGKILLed mid-epoch to the first training step after it.

    .venv/bin/python bench/ray_restart_cost.py [--runs 2] [--nodes 2]

The cluster and the job are those of the killed-worker test (``tests/integration/test_ray_training.py``): with
``--nodes 2`` a head on this machine and a worker node in a network namespace of its own (root and iproute2), one
CPU each; with ``--nodes 1`` one head with two CPUs. The job is the tabular recipe's tiny config on the demo
rows, 2 workers, a checkpoint every 10 steps, ``launch.max_restarts=1``. As soon as the checkpoint of step 10
exists, rank 1's process is SIGKILLed; the run resumes from that checkpoint, and rank 0's result says when its
process started and when it finished its first step (``timeline``). Per run: seconds from the kill to the new
rank 0's process start, and to its first step; with ``--lines``, the task log's lines between the two, each with
its seconds since the kill (where the time goes). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAD_IP, WORKER_IP = "10.231.19.1", "10.231.19.2"
CHECKPOINT_EVERY = 10


def cluster(nodes: int, stack) -> str:
    """The Jobs API address of a cluster of ``nodes`` (1 or 2) nodes, stopped when ``stack`` closes."""
    from pipeline.job.ray.cluster import LocalCluster
    from tests.netns import NetworkNamespace
    from tests.ray_cluster import WorkerNode, wait_for_nodes

    if nodes == 1:
        head = LocalCluster(cpus=2, grace_period_s=5)
        head.start(print)
        stack.callback(head.stop)
        return head.address
    namespace = NetworkNamespace(f"rayb{os.getpid() % 10000}", HEAD_IP, WORKER_IP)
    if not namespace.create():
        sys.exit("--nodes 2 needs root and iproute2 (network namespaces)")
    stack.callback(namespace.remove)
    head = LocalCluster(cpus=1, grace_period_s=5, node_ip=HEAD_IP, env={"GLOO_SOCKET_IFNAME": namespace.host_dev})
    head.start(print)
    stack.callback(head.stop)
    worker = WorkerNode(head.gcs_address, node_ip=WORKER_IP, cpus=1, wrap=namespace.wrap(),
                        env={"GLOO_SOCKET_IFNAME": namespace.dev})
    stack.callback(worker.stop)
    wait_for_nodes(head.address, 2)
    return head.address


def job_entry(home: Path) -> list[str]:
    from pipeline import stages
    from pipeline.data import demo
    from pipeline.recipes import tabular_mlp

    cfg = tabular_mlp.config("tiny").with_overrides({
        "data.input_path": str(demo.write_parquet(home / "inputs" / "demo.parquet", 6_000, seed=1)),
        "train.epochs": 2, "train.batch_size": 32, "train.checkpoint_every_steps": CHECKPOINT_EVERY,
        "train.log_every_steps": 5})
    dataset = stages.prepare_data(cfg, stages.RunInfo("ray", "prep"))
    config_path = home / "config.json"
    config_path.write_text(json.dumps(cfg.to_dict()))
    return ["-m", "pipeline.rank", "--config", str(config_path), "--dataset", dataset.uri]


def killed_run(address: str, entry: list[str], out: Path, show_lines: bool = False) -> dict:
    from pipeline.job.spec import JobSpec, launch_config
    from pipeline.job.supervisor import Job
    from tests.faults import when_checkpoint

    killed: dict = {}

    def kill(beats) -> None:
        killed["at"] = time.time()
        os.kill(beats[1]["pid"], 9)

    options = {"kind": "ray", "nproc_per_node": 2, "grace_period_s": 3, "max_restarts": 1,
               "ray": {"address": address, "python": sys.executable, "cpus_per_worker": 1}}
    spec = JobSpec(entry=entry, job_dir=out, launch=launch_config(options), name="restartcost",
                   labels={"dag_id": "bench", "run_id": out.name, "task_id": "train", "try_number": "1"})
    lines: list[str] = []
    seen: list[tuple[float, str]] = []

    def emit(line: str) -> None:
        lines.append(line)
        seen.append((time.time(), line))

    watcher = when_checkpoint(out, kill, CHECKPOINT_EVERY)
    result = Job(spec).run(emit)
    watcher.join(timeout=5)
    if "at" not in killed or not 0 < result["start_step"] < result["steps"]:
        raise SystemExit(f"the run was not killed and resumed: killed={killed}, start_step={result.get('start_step')}")
    timeline = result["timeline"]
    if show_lines:
        for at, line in seen:
            if killed["at"] <= at <= timeline["first_step"] + 2:
                print(f"  +{at - killed['at']:6.2f}s {line[:160]}")
    return {"to_process_start_s": round(timeline["process_start"] - killed["at"], 2),
            "to_first_step_s": round(timeline["first_step"] - killed["at"], 2), "resumed_at_step": result["start_step"],
            "jobs_submitted": sum(line.startswith("submitting Ray job") for line in lines)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=2)
    parser.add_argument("--lines", action="store_true", help="the task log's lines from the kill to the first step")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    os.environ["PIPELINE_HOME"] = str(home)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    sys.path.insert(0, str(ROOT))
    import contextlib

    import pipeline

    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, home, True)
        address = cluster(args.nodes, stack)
        entry = job_entry(home)
        runs = []
        for run in range(args.runs):
            runs.append(killed_run(address, entry, home / f"run-{run}", args.lines))
            print(f"run {run + 1}: {runs[-1]}", flush=True)
    print(json.dumps({"project": str(Path(pipeline.__file__).parent.parent), "nodes": args.nodes, "runs": runs,
                      "median_to_first_step_s": statistics.median(r["to_first_step_s"] for r in runs)}))


if __name__ == "__main__":
    main()
