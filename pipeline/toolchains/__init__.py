"""Third-party fine-tuning toolchains (Unsloth, Axolotl, LLM Foundry), each in an environment of its own.

Their pins conflict with the project's and with each other's (torch, transformers, MLflow, even Python), so a
toolchain never shares the project's interpreter. ``toolchains/<name>/`` holds what defines one:

- ``toolchain.json``: its Python version, the exception types that mean a mistake in its configuration, a
  module that must import once it is built, and variables its ranks get (``env``);
- ``requirements.in``: its top-level pins; ``requirements.txt``: the lock, every package pinned and hashed
  (``python -m pipeline.toolchains lock NAME`` writes it from PyPI);
- its training config or script;

and ``toolchains/Dockerfile`` builds the image its Kubernetes pods run (``Toolchain.docker_build``).

``python -m pipeline.toolchains build NAME`` (``make toolchain NAME=...``) builds the environment once into a
cache outside the clone (``PIPELINE_TOOLCHAIN_CACHE``, default ``~/.cache/ddp-pipelines/toolchains``), in a
folder keyed by the lock's hash, so that later clones, CI and every task reuse it.

Under ``TorchrunOperator(toolchain=NAME)`` the torchrun agent is the toolchain's own
(``<env>/bin/python -m torch.distributed.run``): agent and ranks run the same torch, so the rendezvous store
they share speaks one version of its protocol, whichever torch the project pins. Each rank runs its entry
through ``pipeline.toolchains.rank``, which turns the toolchain's configuration errors into user errors
(failed at once, not retried). This module imports nothing beyond the standard library: the rank wrapper
imports it in the toolchain's interpreter.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pipeline.errors import ConfigError

TOOLCHAINS_DIR = Path(__file__).resolve().parent.parent.parent / "toolchains"
CACHE_ENV = "PIPELINE_TOOLCHAIN_CACHE"
BUILT_MARKER = ".built.json"  # written last: a folder without it is a build that did not finish


def cache_root() -> Path:
    """Where built environments live (``PIPELINE_TOOLCHAIN_CACHE``, default ``$XDG_CACHE_HOME`` or ``~/.cache``,
    then ``ddp-pipelines/toolchains``): outside the clone, shared by every clone and CI run on the machine."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser().resolve()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return (base / "ddp-pipelines" / "toolchains").resolve()


def names() -> list[str]:
    """The toolchains this project defines (folders of ``toolchains/`` with a ``toolchain.json``)."""
    return sorted(p.parent.name for p in TOOLCHAINS_DIR.glob("*/toolchain.json"))


def get(name: str) -> "Toolchain":
    """The toolchain called ``name``; a ``ConfigError`` naming the known ones otherwise."""
    if name not in names():
        raise ConfigError(f"toolchain {name!r} is not defined: expected one of {names()} "
                          f"(folders of {TOOLCHAINS_DIR} with a toolchain.json)")
    return Toolchain(name)


def write_result(result: dict) -> None:
    """In rank 0 of a toolchain's script: its result where the supervisor reads it (``$PIPELINE_RESULT_FILE``,
    written whole or not at all; the task's XCom, ``model_dir`` what ``adopt`` registers), and on stdout."""
    path = os.environ.get("PIPELINE_RESULT_FILE")
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as fh:
            json.dump(result, fh)
        os.replace(tmp, path)
    print(json.dumps(result), flush=True)


@dataclass(frozen=True)
class Toolchain:
    name: str

    @property
    def folder(self) -> Path:
        return TOOLCHAINS_DIR / self.name

    @property
    def lock(self) -> Path:
        return self.folder / "requirements.txt"

    @property
    def spec(self) -> dict:
        return json.loads((self.folder / "toolchain.json").read_text())

    @property
    def python_version(self) -> str:
        return str(self.spec["python"])

    @property
    def config_errors(self) -> list[str]:
        """Qualified names of the exception types that mean a mistake in the toolchain's configuration."""
        return list(self.spec.get("config_errors", []))

    @property
    def key(self) -> str:
        """The lock's hash: a changed lock is a new environment, built beside the old one."""
        return hashlib.sha256(self.lock.read_bytes()).hexdigest()[:16]

    @property
    def env_dir(self) -> Path:
        return cache_root() / f"{self.name}-{self.key}"

    @property
    def python(self) -> Path:
        return self.env_dir / "bin" / "python"

    @property
    def image(self) -> str:
        """The image its Kubernetes pods run, tagged with the lock's hash."""
        return f"ddp-pipelines-{self.name.replace('_', '-')}:{self.key}"

    @property
    def docker_build(self) -> str:
        """The command that builds ``image`` from the project's root."""
        return (f"docker build -f toolchains/Dockerfile --build-arg TOOLCHAIN={self.name} "
                f"--build-arg PYTHON={self.python_version} -t {self.image} .")

    def launch_in_image(self, launch):
        """``launch`` (a ``LaunchConfig``) with the toolchain's image for its pods, unless the task names one."""
        import dataclasses

        kube = launch.kubernetes
        if kube.image != type(kube)().image:
            return launch
        return dataclasses.replace(launch, kubernetes=dataclasses.replace(kube, image=self.image))

    def built(self) -> dict | None:
        """The build's record (seconds, download and disk size), if this lock's environment is complete."""
        marker = self.env_dir / BUILT_MARKER
        return json.loads(marker.read_text()) if marker.is_file() else None

    def require(self) -> "Toolchain":
        """This toolchain, if its environment is built; a ``ConfigError`` that says how to build it otherwise."""
        if self.built() is None:
            raise ConfigError(f"toolchain {self.name!r} is not built (no complete environment at {self.env_dir}, "
                              f"the lock {self.lock} as hashed): run `make toolchain NAME={self.name}`")
        return self

    def rank_entry(self, entry: Sequence[str], no_python: bool) -> list[str]:
        """What torchrun (``--no-python``) runs in each rank: a Python entry (``-m module ...`` or ``script.py
        ...``) through the toolchain's interpreter and ``pipeline.toolchains.rank``; an executable as it is,
        found first in the toolchain's ``bin``."""
        if no_python:
            return list(entry)
        wrapper = ["-m", "pipeline.toolchains.rank", *(f"--config-error={name}" for name in self.config_errors), "--"]
        return ["python", *wrapper, *entry]

    def rank_env(self, env: dict[str, str], project_root: Path) -> dict[str, str]:
        """The ranks' environment: the toolchain's own variables (``toolchain.json``'s ``env``: its telemetry off),
        the toolchain's ``bin`` first on ``PATH`` (``python`` is its interpreter), and
        only the project's root on ``PYTHONPATH`` (for ``pipeline.toolchains.rank`` and ``pipeline.errors``, which
        import nothing but the standard library): none of the project's packages reach the toolchain."""
        bin_dir = str(self.env_dir / "bin")
        return {**env, **self.spec.get("env", {}), "PATH": os.pathsep.join(filter(None, [bin_dir, env.get("PATH")])),
                "VIRTUAL_ENV": str(self.env_dir), "PYTHONPATH": str(project_root), "PYTHONNOUSERSITE": "1"}
