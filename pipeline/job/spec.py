"""The job contract: one job spec, the job folder every rank and the supervisor share, and the registry
of places to run it (``launch.kind``).

The job's files live in ``job_dir``, the same folder on every try of a task, where every rank can
reach it; ``JobFiles`` is its only definition, and the ranks find it from the environment it exports.
What every place guarantees is ``pipeline.job.supervisor``'s.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from pipeline.config import LaunchConfig, PipelineConfig

# launch.kind -> the place that runs its attempts (pipeline.job.supervisor.Place), imported on use.
PLACES = {"local": "pipeline.job.local.place:LocalPlace", "kubernetes": "pipeline.job.kubernetes.place:KubernetesPlace",
          "ray": "pipeline.job.ray.place:RayPlace"}


@dataclass(frozen=True)
class JobFiles:
    """The layout of a job's folder; each path is exported to the ranks as an environment variable."""

    root: Path

    @classmethod
    def from_env(cls) -> "JobFiles | None":
        """In a rank: the job folder the launcher exported (``PIPELINE_JOB_DIR``), if any."""
        import os

        root = os.environ.get("PIPELINE_JOB_DIR")
        return cls(Path(root)) if root else None

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def result(self) -> Path:  # rank 0's JSON result: the task's XCom
        return self.root / "result.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:  # rank 0's metrics, one JSON line per call; the task sends them to MLflow
        return self.root / "metrics.jsonl"

    @property
    def progress(self) -> Path:  # per-rank heartbeats, read by the stall watchdog
        return self.root / "progress"

    @property
    def errors(self) -> Path:  # user errors reported by ranks (pipeline.errors.user_errors_reported)
        return self.root / "errors"

    def logs(self, try_number: int) -> Path:
        return self.root / f"logs-try{try_number}"

    def env(self) -> dict[str, str]:
        from pipeline.errors import ERROR_DIR_ENV
        from pipeline.train.progress import PROGRESS_DIR_ENV

        return {"PIPELINE_JOB_DIR": str(self.root), "PIPELINE_CHECKPOINT_DIR": str(self.checkpoints),
                "PIPELINE_RESULT_FILE": str(self.result), PROGRESS_DIR_ENV: str(self.progress),
                ERROR_DIR_ENV: str(self.errors)}

    def expand(self, text: str) -> str:
        """``text`` with ``${PIPELINE_JOB_DIR}``, ``${PIPELINE_CHECKPOINT_DIR}`` (the variables of ``env``) replaced by
        their paths: a CLI's arguments name the job's folders without a shell."""
        paths = self.env()
        return re.sub(r"\$\{(PIPELINE_[A-Z_]+)\}", lambda m: paths.get(m.group(1), m.group(0)), text)

    def read_result(self) -> dict[str, Any] | None:
        return json.loads(self.result.read_text()) if self.result.exists() else None


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """One training job: what to run (``entry``), on how many nodes and ranks with which resources and
    limits (``launch``), with which environment, and where its files live (``job_dir``)."""

    entry: Sequence[str]  # ["-m", "pkg.module", *args], ["script.py", *args], or an executable with no_python
    job_dir: Path
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    no_python: bool = False
    toolchain: str | None = None  # a third-party toolchain's own environment (pipeline.toolchains) runs the ranks
    env: dict[str, str] = field(default_factory=dict)
    name: str = "job"  # unique per DAG run and try: labels, rendezvous ids
    try_number: int = 1
    labels: dict[str, str] = field(default_factory=dict)  # dag_id, run_id, task_id, map_index, try_number

    @property
    def files(self) -> JobFiles:
        return JobFiles(Path(self.job_dir))


def attempt_id(spec_name: str, labels: dict[str, str], restart: int = 0) -> str:
    """A DNS-1123 name unique per DAG run, task, try and restart, at most 52 characters: the Kubernetes
    place's object names (a pod's hostname ``NAME-INDEX`` must fit in 63), the Ray place's submission id."""
    identity = json.dumps([spec_name, labels.get("dag_id"), labels.get("run_id"), labels.get("task_id"),
                           labels.get("map_index"), labels.get("try_number"), restart])
    digest = hashlib.sha256(identity.encode()).hexdigest()[:8]
    readable = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", spec_name.lower())).strip("-")[:35].strip("-") or "job"
    return f"{readable}-{digest}-r{restart}"


def launch_config(options: dict[str, Any] | LaunchConfig | None = None) -> LaunchConfig:
    """A validated ``LaunchConfig`` from keyword options (the same names and rules as ``launch.*``)."""
    if isinstance(options, LaunchConfig):
        return options
    from pipeline.config_fields import flatten

    return PipelineConfig().with_overrides(flatten(dict(options or {}), "launch.")).launch
