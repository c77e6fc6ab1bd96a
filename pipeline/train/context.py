"""The run context every rank of a training job shares with the pipeline, whoever owns the loop.

Checkpoint folder, heartbeat, metrics sink (rank 0, to the job folder), result file: the generic loop
uses them directly; framework trainers reach them through callbacks (``pipeline.train.callbacks``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from pipeline.diskspace import write_atomically
from pipeline.job_files import JobFiles
from pipeline.train import distributed
from pipeline.train.checkpoint import CheckpointStore
from pipeline.job_files import Heartbeat


class MetricsSink:
    """Rank 0's metrics, appended to the job folder's ``metrics.jsonl`` (one line per call, written whole); the
    task that supervises the job sends them to its MLflow run (``pipeline.registry.metrics_relay``). Ranks never import
    MLflow: it would cost seconds before the first step, and every rank waits for rank 0 there."""

    def __init__(self, path: Path | None):
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")
            if self._file.tell() and _last_byte(path) != b"\n":
                self._file.write("\n")  # a line cut short by a killed attempt stays on its own

    def log(self, values: dict[str, float], step: int) -> None:
        if self._file is not None:
            row = {"step": step, "timestamp": int(time.time() * 1000),
                   "metrics": {key: float(value) for key, value in values.items()}}
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1)


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
