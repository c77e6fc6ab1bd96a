"""The run context every rank of a training job shares with the pipeline, whoever owns the loop.

Checkpoint folder, heartbeat, metrics sink (rank 0, buffered to MLflow), result file: the generic loop
uses them directly; framework trainers reach them through callbacks (``pipeline.train.callbacks``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pipeline.diskspace import write_atomically
from pipeline.job.spec import JobFiles
from pipeline.train import distributed
from pipeline.train.checkpoint import CheckpointStore
from pipeline.train.progress import Heartbeat



class MetricsSink:
    """Rank 0's metrics, sent to the MLflow run named by ``MLFLOW_RUN_ID`` without blocking training."""

    def __init__(self, enabled: bool):
        self.run_id = os.environ.get("MLFLOW_RUN_ID") if enabled else None
        self._logger = None
        if self.run_id:
            from pipeline.registry.buffered import BufferedMetricLogger, mlflow_sender
            from pipeline.registry.tracking import client

            self._logger = BufferedMetricLogger(mlflow_sender(client(), self.run_id))

    def log(self, values: dict[str, float], step: int) -> None:
        if self._logger:
            self._logger.log(values, step)

    def close(self, timeout_s: float, spill_path: Path) -> int:
        return self._logger.close(timeout_s, spill_path) if self._logger else 0


class RunContext:
    """One rank's view of the job: ``dist`` (rank, world, device), ``out_dir`` with its files."""

    def __init__(self, cfg, dist: distributed.DistContext, out_dir: Path):
        self.cfg = cfg
        self.dist = dist
        self.out_dir = Path(out_dir)
        self.files = JobFiles(self.out_dir)  # the job folder's one definition, shared with the supervisor
        self.checkpoint_dir = self.files.checkpoints
        self.checkpoints = CheckpointStore(self.checkpoint_dir, keep=cfg.train.keep_checkpoints)
        self.heartbeat = Heartbeat.from_env(dist.rank)
        self.metrics = MetricsSink(dist.is_main)

    @property
    def is_main(self) -> bool:
        return self.dist.is_main

    def log(self, message: str) -> None:
        """A line in the task log, from rank 0 only."""
        if self.dist.is_main:
            print(message, flush=True)

    def finish(self, result: dict[str, Any]) -> dict[str, Any]:
        """Rank 0: flush metrics (spilling what cannot be sent) and write ``result.json`` atomically, last."""
        result = dict(result, mlflow_run_id=self.metrics.run_id, unsent_metrics_path=str(self.files.unsent_metrics))
        if self.dist.is_main:
            result["unsent_metrics"] = self.metrics.close(self.cfg.train.metrics_flush_timeout_s,
                                                          self.files.unsent_metrics)
            # Written last, whole or not at all: the result appears only once everything is saved.
            write_atomically(self.files.result, json.dumps(result, indent=2).encode())
        return result
