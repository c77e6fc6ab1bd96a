"""Where things live: every location comes from an environment variable with a project-local default."""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def home() -> Path:
    """Root of everything the pipeline writes (``PIPELINE_HOME``, default ``<project>/var``)."""
    return Path(os.environ.get("PIPELINE_HOME", PROJECT_ROOT / "var")).resolve()


def data_dir() -> Path:
    """Published MDS datasets (``PIPELINE_DATA_DIR``, default ``$PIPELINE_HOME/data``)."""
    return Path(os.environ.get("PIPELINE_DATA_DIR", home() / "data")).resolve()


def runs_dir() -> Path:
    """Per-DAG-run working folders: configs, checkpoints, results (``PIPELINE_RUNS_DIR``)."""
    return Path(os.environ.get("PIPELINE_RUNS_DIR", home() / "runs")).resolve()


def retry_delay_s() -> float:
    """Wait before an Airflow retry of a failed task (``PIPELINE_RETRY_DELAY_S``, default 30)."""
    return float(os.environ.get("PIPELINE_RETRY_DELAY_S", 30))


def mlflow_tracking_uri() -> str:
    """MLflow tracking URI (``MLFLOW_TRACKING_URI``, default a SQLite file under ``$PIPELINE_HOME``)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{home() / 'mlflow' / 'mlflow.db'}"


def mlflow_artifact_root() -> str:
    """Artifact location for experiments this pipeline creates (``PIPELINE_MLFLOW_ARTIFACTS``)."""
    return os.environ.get("PIPELINE_MLFLOW_ARTIFACTS", (home() / "mlflow" / "artifacts").as_uri())


def airflow_base_url() -> str:
    """Base URL of the Airflow UI, for links from MLflow back to DAG runs (``AIRFLOW__API__BASE_URL``)."""
    return os.environ.get("AIRFLOW__API__BASE_URL", "http://127.0.0.1:8080").rstrip("/")


def airflow_env(airflow_home: Path | None = None) -> dict[str, str]:
    """Environment for the embedded Airflow: SQLite, LocalExecutor, low parallelism, this project's DAGs.

    Values already set in the environment win, so a user can point at PostgreSQL or another home.
    """
    airflow_home = Path(os.environ.get("AIRFLOW_HOME", airflow_home or home() / "airflow")).resolve()
    defaults = {
        "AIRFLOW_HOME": str(airflow_home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(PROJECT_ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(PROJECT_ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{airflow_home / 'airflow.db'}",
        # 64+ bytes, or Airflow signs task tokens with a short ephemeral key and warns.
        "AIRFLOW__API_AUTH__JWT_SECRET": "embedded-default-not-for-production-" + "0" * 40,
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
    }
    env = {key: os.environ.get(key, value) for key, value in defaults.items()}
    # DAG files, plugins and task processes import `pipeline` from the project root.
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([str(PROJECT_ROOT), *paths]))
    return env


def apply_airflow_env(airflow_home: Path | None = None) -> dict[str, str]:
    """Put :func:`airflow_env` into ``os.environ`` (before anything imports airflow) and return it."""
    env = airflow_env(airflow_home)
    os.environ.update(env)
    Path(env["AIRFLOW_HOME"]).mkdir(parents=True, exist_ok=True)
    return env


def dataset_uri(name: str) -> str:
    """The URI of a dataset's Airflow Asset: the folder its versions are published under."""
    return (data_dir() / name).as_uri()
