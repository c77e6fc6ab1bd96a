"""Which DAG run a stage or a training job works for: keys its MLflow run, model version and job folder."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pipeline import deployment


@dataclass(frozen=True)
class RunInfo:
    dag_id: str
    run_id: str
    try_number: int = 1
    logical_date: str | None = None
    data_interval_start: str | None = None
    data_interval_end: str | None = None

    @property
    def key(self) -> str:
        return f"{self.dag_id}/{self.run_id}"

    @property
    def workdir(self) -> Path:
        return deployment.runs_dir() / self.dag_id / re.sub(r"[^A-Za-z0-9._-]+", "_", self.run_id)

    def job_dir(self, task_id: str, map_index: int = -1) -> Path:
        """The folder of one task's training job: the same on every try of that task instance, so a
        retry finds the previous try's checkpoints."""
        folder = self.workdir / task_id
        return folder / f"map-{map_index}" if map_index >= 0 else folder

    @property
    def url(self) -> str:
        """The DAG run's page in the Airflow UI."""
        from urllib.parse import quote

        return f"{deployment.airflow_base_url()}/dags/{quote(self.dag_id)}/runs/{quote(self.run_id, safe='')}"

    def tags(self) -> dict[str, str]:
        """Lineage tags shared by the MLflow run and the model version."""
        tags = {
            "airflow.dag_id": self.dag_id, "airflow.run_id": self.run_id, "airflow.try_number": str(self.try_number),
            "airflow.url": self.url,
        }
        for key in ("logical_date", "data_interval_start", "data_interval_end"):
            if getattr(self, key):
                tags[f"airflow.{key}"] = getattr(self, key)
        return tags
