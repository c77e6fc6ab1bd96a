"""The run context every rank of a training job shares with the pipeline, whoever owns the loop.

Checkpoint folder, heartbeat, metrics sink (rank 0, to the job folder), result file: the generic loop
uses them directly; framework trainers reach them through callbacks (``pipeline.train.callbacks``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pipeline import deployment, storage
from pipeline.diskspace import write_atomically
from pipeline.job_files import JOB_STORE_ENV, Heartbeat, JobFiles, MetricsSink
from pipeline.train import distributed
from pipeline.train.checkpoint import CheckpointStore


class RunContext:
    """One rank's view of the job: ``dist`` (rank, world, device), ``out_dir`` with its files."""

    def __init__(self, cfg, dist: distributed.DistContext, out_dir: Path):
        self.cfg = cfg
        self.dist = dist
        self.out_dir = Path(out_dir)
        self.files = JobFiles(self.out_dir)  # the job folder's one definition, shared with the supervisor
        self.checkpoint_dir = self.files.checkpoints  # a trainer's own checkpoints (Hugging Face's): on this node
        self.checkpoints = CheckpointStore(checkpoint_location(cfg.train.checkpoint_uri, self.out_dir),
                                           keep=cfg.train.keep_checkpoints)
        self.heartbeat = Heartbeat.from_env(dist.rank)
        self.metrics = MetricsSink(self.files.metrics if dist.is_main else None)

    @property
    def is_main(self) -> bool:
        return self.dist.is_main

    def log(self, message: str) -> None:
        """A line in the task log, from rank 0 only."""
        if self.dist.is_main:
            print(message, flush=True)

    def finish(self, result: dict[str, Any]) -> dict[str, Any]:
        """Rank 0: close the metrics file and write ``result.json`` atomically, last."""
        if self.dist.is_main:
            self.metrics.close()
            # Written last, whole or not at all: the result appears only once everything is saved.
            write_atomically(self.files.result, json.dumps(result, indent=2).encode())
        return result


def checkpoint_location(uri: str, job_dir: Path) -> Path | str:
    """Where the checkpoints of the job in ``job_dir`` live: under ``uri``, the job's own prefix
    (``deployment.job_key``); without one, the job folder's ``checkpoints/``, on the object store with it when the
    job's nodes share no folder (``pipeline.job.mirror``: the supervisor exports where)."""
    if uri:
        return storage.join(uri, deployment.job_key(job_dir))
    store = os.environ.get(JOB_STORE_ENV)
    return storage.join(store, "checkpoints") if store else JobFiles(job_dir).checkpoints
