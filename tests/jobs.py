"""Running a supervised local torchrun job to its end from a test, as the train task does."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from pipeline.job.spec import JobSpec, launch_config
from pipeline.job.supervisor import Job


def run_torchrun(entry: Sequence[str], *, job_dir: Path, emit: Callable[[str], None] | None = None,
                 env: dict[str, str] | None = None, no_python: bool = False, **launch) -> dict | None:
    """One local job of ``entry``; ``launch``: ``launch.*`` fields (nproc_per_node, max_restarts,
    stall_timeout_s, ...). Returns rank 0's result, if it wrote one."""
    spec = JobSpec(entry=list(entry), job_dir=Path(job_dir), launch=launch_config({"kind": "local", **launch}),
                   env=dict(env or {}), no_python=no_python)
    return Job(spec).run(emit)


def train(cfg, run, dataset):
    """The recipe DAGs' train task outside Airflow, on the same path (``TrainOperator``): the run's job from
    ``stages.train_job``, run by the supervisor, read back by ``stages.trained_model``."""
    import time

    from pipeline import stages

    started = time.perf_counter()
    spec = stages.train_job(cfg, run, dataset)
    result = Job(spec, metrics_flush_timeout_s=cfg.train.metrics_flush_timeout_s).run()
    return stages.trained_model(spec, result, time.perf_counter() - started)
