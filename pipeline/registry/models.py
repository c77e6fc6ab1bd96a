"""Logging, registering and aliasing model versions, idempotently per DAG run."""

from __future__ import annotations

import logging
import threading
from typing import Any

from pipeline.errors import UserError
from pipeline.registry.package import ModelPackage
from pipeline.registry.tracking import RUN_KEY_TAG, client
from pipeline.stopwatch import Stopwatch

log = logging.getLogger(__name__)

_LOADING = threading.Lock()

CHALLENGER = "challenger"
CHAMPION = "champion"


def versions_for(model_name: str, run_key: str) -> list:
    """Versions of ``model_name`` tagged with ``run_key``, oldest first."""
    found = client().search_model_versions(f"name = '{model_name}' and tags.`{RUN_KEY_TAG}` = '{run_key}'")
    return sorted(found, key=lambda v: int(v.version))


def find_version(model_name: str, run_key: str):
    """The version registered for ``run_key`` (a retried task must not register a second one)."""
    found = versions_for(model_name, run_key)
    return found[0] if found else None


def _settle(model_name: str, run_key: str, mine: str) -> str:
    """After registering: keep the oldest version of ``run_key``; delete ours if it is not that one.

    MLflow has no conditional create, so attempts racing past ``find_version`` each register a
    version. Each then looks again; every one but the oldest's creator deletes its own, so exactly
    one version survives, and all racers return it.
    """
    oldest = versions_for(model_name, run_key)[0]
    if str(oldest.version) != mine:
        log.info("version %s of %s lost a registration race for %s to version %s: deleting it",
                 mine, model_name, run_key, oldest.version)
        client().delete_model_version(model_name, mine)
    return str(oldest.version)


def log_and_register(*, run_id: str, model_name: str, run_key: str, package: ModelPackage,
                     tags: dict[str, str], phases: Stopwatch | None = None) -> tuple[str, bool]:
    """Log a recipe's ``ModelPackage`` (a models-from-code pyfunc and its artifacts, or another flavor's
    model) into ``run_id`` and register it once per ``run_key``; returns ``(version, created)``. ``phases``
    times "model logging" and "registration"."""
    phases = phases or Stopwatch()
    existing = find_version(model_name, run_key)
    if existing is not None:
        log.info("model %s version %s already registered for %s: reusing it", model_name, existing.version, run_key)
        return str(existing.version), False

    import importlib

    import mlflow
    import torch

    flavor = importlib.import_module(f"mlflow.{package.flavor}")
    requirements = package.pip_requirements or [
        f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}", "pandas", "numpy"]
    # One save: MLflow infers the signature from what the model itself returns for the example, and checks
    # the example as a serving request would send it. MLflow only warns when either fails, so a model
    # without a signature is refused here, before anything is registered.
    with phases("model logging"), _LOADING, mlflow.start_run(run_id=run_id):  # models-from-code: a process global
        info = flavor.log_model(name="model", **package.log_args(), input_example=package.input_example,
                                pip_requirements=requirements)
    if info.signature is None:
        raise UserError(f"model {model_name} ({package.flavor}) failed on its input example, so it has no "
                        f"signature and was not registered: see MLflow's warning above; logged at {info.model_uri}")
    with phases("registration"):
        version = mlflow.register_model(info.model_uri, model_name, tags={RUN_KEY_TAG: run_key, **tags})
        kept = _settle(model_name, run_key, str(version.version))
    log.info("registered %s version %s from %s", model_name, kept, info.model_uri)
    return kept, kept == str(version.version)


def input_schema(model_name: str, version: str) -> list | None:
    """The input columns (name, type) of a registered version's signature, for telling whether two
    versions take the same rows."""
    from mlflow.models import get_model_info

    signature = get_model_info(f"models:/{model_name}/{version}").signature
    return signature.inputs.to_dict() if signature is not None and signature.inputs is not None else None


def set_alias(model_name: str, alias: str, version: str) -> None:
    client().set_registered_model_alias(model_name, alias, version)


def version_by_alias(model_name: str, alias: str):
    """The model version behind ``alias``, or None when the alias (or the model) does not exist."""
    from mlflow.exceptions import MlflowException

    try:
        return client().get_model_version_by_alias(model_name, alias)
    except MlflowException:
        return None


def aliases(model_name: str, version: str) -> list[str]:
    return sorted(client().get_model_version(model_name, version).aliases)


def tag_version(model_name: str, version: str, tags: dict[str, Any]) -> None:
    mlflow_client = client()
    for key, value in tags.items():
        mlflow_client.set_model_version_tag(model_name, version, key, str(value))
