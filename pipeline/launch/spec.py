"""The launcher interface: one job spec, one registry of places to run it (``launch.kind``).

Every launcher guarantees the same things: live rank-prefixed logs, errors classified (a rank's user
error fails at once, with no restart and no retry; infrastructure faults restart up to
``max_restarts`` and are retryable), restarts that resume from the last checkpoint, and nothing left
running when the task ends for any reason. The job's files live in ``job_dir``, the same folder on
every try of a task, where every rank can reach it.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from pipeline.config import LaunchConfig, PipelineConfig
from pipeline.errors import ConfigError

LAUNCHERS = {"local": "pipeline.launch.local:LocalLauncher", "kubernetes": "pipeline.launch.kube:KubernetesLauncher"}


@dataclass(frozen=True)
class JobFiles:
    """The layout of a job's folder; each path is exported to the ranks as an environment variable."""

    root: Path

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
    env: dict[str, str] = field(default_factory=dict)
    name: str = "job"  # unique per DAG run and try: labels, rendezvous ids
    try_number: int = 1
    labels: dict[str, str] = field(default_factory=dict)  # dag_id, run_id, task_id, map_index, try_number

    @property
    def files(self) -> JobFiles:
        return JobFiles(Path(self.job_dir))


class Launcher(Protocol):
    def run(self, spec: JobSpec, emit: Callable[[str], None]) -> None:
        """Run the job to completion; raise ``RankUserError`` or ``TrainingFailed``/``TrainingStalled``."""

    def stop(self) -> None:
        """Stop the job for good, from any thread (``on_kill``, a signal); nothing of it stays running."""


def launch_config(options: dict[str, Any] | LaunchConfig | None = None) -> LaunchConfig:
    """A validated ``LaunchConfig`` from keyword options (the same names and rules as ``launch.*``)."""
    if isinstance(options, LaunchConfig):
        return options
    from pipeline.config import flatten

    return PipelineConfig().with_overrides(flatten(dict(options or {}), "launch.")).launch


def launcher_for(spec: JobSpec) -> Launcher:
    kind = spec.launch.kind
    if kind not in LAUNCHERS:
        raise ConfigError(f"launch.kind={kind!r}: expected one of {sorted(LAUNCHERS)}")
    module, _, attr = LAUNCHERS[kind].partition(":")
    return getattr(importlib.import_module(module), attr)()


class Job:
    """A job spec bound to its launcher: ``run()`` blocks and returns rank 0's result; ``stop()`` from anywhere."""

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.launcher = launcher_for(spec)

    def run(self, emit: Callable[[str], None] | None = None) -> dict[str, Any] | None:
        import logging

        files = self.spec.files
        files.root.mkdir(parents=True, exist_ok=True)
        files.result.unlink(missing_ok=True)  # never report a previous try's result
        self.launcher.run(self.spec, emit or logging.getLogger(__name__).info)
        return files.read_result()

    def stop(self) -> None:
        self.launcher.stop()
