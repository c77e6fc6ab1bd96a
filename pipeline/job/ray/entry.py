"""The Ray job's driver: ``python -m pipeline.job.ray.entry --job JSON -- ENTRY...`` builds Ray Train's
``TorchTrainer`` from the launch config and runs ``pipeline.job.ray.worker.run_rank`` on every worker.

- ``ScalingConfig``: ``launch.nnodes x launch.nproc_per_node`` workers (elastic, from ``launch.min_nnodes x
  launch.nproc_per_node``: a job submitted after a node was lost starts with the workers that fit),
  ``launch.ray.cpus_per_worker`` CPUs and one GPU each when ``launch.gpus_per_node`` asks for GPUs;
- ``RunConfig``: named by the run key (the same on every try of the task and every restart, so that each job
  finds the same run), stored in the job folder's checkpoints (or, for nodes that share no folder, in the job
  folder's copy on the object store: ``pipeline.job.mirror``, read through pyarrow with ``AWS_ENDPOINT_URL``);
- ``FailureConfig``: Ray Train restarts no worker group, failed or preempted (``max_failures=0``,
  ``max_preemption_failures=0``): the job ends, and the supervisor decides as on every place whether a new job
  resumes from the job folder's checkpoints (a rank's user error never does). A worker group that could not
  start is not a restart: the controller tries again up to ``launch.max_restarts`` times
  (``controller_failure_limit``), so that a job submitted right after a node was lost, which first asks for the
  lost node's CPUs still counted, starts on the workers that fit.
"""

from __future__ import annotations

import argparse
import json
import sys


def trainer(job: dict, entry: list[str]):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from pipeline.job.ray.worker import run_rank
    from pipeline.job.spec import launch_config

    launch = launch_config(job["launch"])
    workers = launch.nnodes * launch.nproc_per_node
    use_gpu = launch.gpus_per_node > 0
    resources = {"CPU": launch.ray.cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
    backend = {"auto": "nccl" if use_gpu else "gloo"}.get(launch.backend, launch.backend)
    return TorchTrainer(
        run_rank,
        train_loop_config={"entry": entry, "no_python": job.get("no_python", False), "job_dir": job["job_dir"],
                           "store": job.get("store")},
        torch_config=TorchConfig(backend=backend),
        scaling_config=ScalingConfig(
            num_workers=(launch.min_nnodes * launch.nproc_per_node, workers) if 0 < launch.min_nnodes < launch.nnodes
            else workers, use_gpu=use_gpu, resources_per_worker=resources),
        run_config=RunConfig(name=job["run_name"], storage_path=job["storage"],
                             failure_config=FailureConfig(max_failures=0, max_preemption_failures=0,
                                                          controller_failure_limit=launch.max_restarts)),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.job.ray.entry", description=__doc__)
    parser.add_argument("--job", required=True, help="JSON: launch (the launch config), run_name, storage, "
                        "job_dir, no_python, store")
    parser.add_argument("entry", nargs=argparse.REMAINDER, help="-- then what each worker runs")
    args = parser.parse_args(argv)
    entry = args.entry[1:] if args.entry[:1] == ["--"] else args.entry
    job = json.loads(args.job)
    from ray.train import TrainingFailedError

    try:
        trainer(job, entry).fit()
    except TrainingFailedError as exc:
        print(f"Ray Train ended the run: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
