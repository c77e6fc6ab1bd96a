"""The job contract: one job spec (what runs, on how many nodes and ranks, with which limits), its attempts, and
the resolution of what runs before a place is chosen (``resolve``).

The job's files live in ``job_dir``, the same folder on every try of a task, where every rank can reach it
(``pipeline.job_files``). Where attempts run is ``pipeline.job.places``; what every place guarantees is
``pipeline.job.supervisor``'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from pipeline.config import PipelineConfig
from pipeline.launch_config import LaunchConfig
from pipeline.errors import ConfigError
from pipeline.job_files import JobFiles


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """One training job: what to run (``entry``), on how many nodes and ranks with which resources and
    limits (``launch``), with which environment, and where its files live (``job_dir``)."""

    entry: Sequence[str]  # ["-m", "pkg.module", *args], ["script.py", *args], or an executable with no_python
    job_dir: Path
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    no_python: bool = False
    toolchain: str | None = None  # a third-party toolchain's own environment (pipeline.toolchains) runs the ranks
    python: str | None = None  # the interpreter of torchrun's agent on this machine (a toolchain's); None: this one
    env: dict[str, str] = field(default_factory=dict)
    name: str = "job"  # unique per DAG run and try: labels, rendezvous ids
    try_number: int = 1
    labels: dict[str, str] = field(default_factory=dict)  # dag_id, run_id, task_id, map_index, try_number

    @property
    def files(self) -> JobFiles:
        return JobFiles(Path(self.job_dir))


@dataclass(frozen=True)
class Attempt:
    """The ``restart``-th start of one try of a job."""

    spec: JobSpec
    restart: int

    @property
    def name(self) -> str:
        """Unique per DAG run, task, try and restart: rendezvous ids, the place's object names."""
        return f"{self.spec.name}-{self.restart}"

    @property
    def id(self) -> str:
        """The same, DNS-1123 and at most 52 characters: a place's object names and idempotency keys."""
        return attempt_id(self.spec.name, self.spec.labels, self.restart)

    @property
    def log_dir(self) -> Path:
        """torchrun's per-rank logs and ``@record`` error files of this attempt."""
        return self.spec.files.logs(self.spec.try_number) / f"torchrun-{self.restart}"

    def env(self) -> dict[str, str]:
        """The ranks' environment, the same on every place: the job's own variables, the job folder's
        paths, the process-group backend, and which try and restart this is."""
        spec = self.spec
        return {**spec.env, **spec.files.env(), "PIPELINE_TRY_NUMBER": str(spec.try_number),
                "PIPELINE_RESTART_COUNT": str(self.restart), "PIPELINE_BACKEND": spec.launch.backend}


# Variables whose values a place must not store in the cluster's API objects (a Job manifest, a Ray job's
# runtime_env: both readable by whoever can list them); the cluster provides them itself.
SECRET_NAME = re.compile(r"PASSWORD|TOKEN|SECRET|CREDENTIAL|(^|_)KEY($|_)", re.IGNORECASE)


def without_secrets(env: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """``env`` less the variables that look like secrets (``SECRET_NAME``), and the names of those left out."""
    left_out = sorted(key for key in env if SECRET_NAME.search(key))
    return {key: value for key, value in env.items() if key not in left_out}, left_out


def resolve(spec: JobSpec) -> JobSpec:
    """``spec`` with what runs settled, before a place is chosen: a toolchain's ranks run through its own
    interpreter and wrapper (``pipeline.toolchains``), in its environment built on this machine (local) or in its
    image (kubernetes). A spec without a toolchain, or resolved already, is returned as it is."""
    if not spec.toolchain:
        return spec
    from pipeline import deployment, toolchains

    if spec.launch.kind == "ray":
        raise ConfigError(f"toolchain {spec.toolchain!r} with launch.kind=ray: a Ray cluster's workers run the "
                          f"project's environment, not a toolchain's; use launch.kind=local or kubernetes "
                          f"(the toolchain's image)")
    toolchain = toolchains.get(spec.toolchain)
    entry = toolchain.rank_entry(spec.entry, spec.no_python)
    if spec.launch.kind == "kubernetes":
        return dataclasses.replace(spec, entry=entry, no_python=True, toolchain=None,
                                   launch=toolchain.launch_in_image(spec.launch))
    toolchain.require()  # not built: a user error before anything starts (not retried)
    env = toolchain.rank_env({**spec.env, "PATH": spec.env.get("PATH", os.environ.get("PATH", ""))}, deployment.PROJECT_ROOT)
    return dataclasses.replace(spec, entry=entry, no_python=True, toolchain=None, python=str(toolchain.python), env=env)


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
