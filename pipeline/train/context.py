"""The run context every rank of a training job shares with the pipeline, whoever owns the loop.

Checkpoint folder, heartbeat, metrics sink (rank 0, to the job folder), result file: the generic loop
uses them directly; framework trainers reach them through callbacks (``pipeline.train.callbacks``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pipeline import deployment, storage
from pipeline.diskspace import write_atomically
from pipeline.job_files import Heartbeat, JobFiles, MetricsSink
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
    """Where the checkpoints of the job in ``job_dir`` live: its ``checkpoints/`` without ``uri``; else its own
    prefix under ``uri``, the job folder's path under the runs folder (``DAG/RUN/TASK``: the same on every try), or
    for a job folder elsewhere its name and a digest of its path."""
    if not uri:
        return JobFiles(job_dir).checkpoints
    job_dir = Path(job_dir).resolve()
    try:
        key = job_dir.relative_to(deployment.runs_dir()).as_posix()
    except ValueError:
        key = f"{job_dir.name}-{hashlib.sha256(str(job_dir).encode()).hexdigest()[:8]}"
    return storage.join(uri, key)
