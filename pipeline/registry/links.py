"""Addresses of MLflow pages (runs, model versions) for links from Airflow."""

from __future__ import annotations

import os
from urllib.parse import quote

from pipeline import deployment


def ui_base() -> str:
    """``PIPELINE_MLFLOW_UI_URL``, else the tracking server itself, else a local ``mlflow ui``."""
    if os.environ.get("PIPELINE_MLFLOW_UI_URL"):
        return os.environ["PIPELINE_MLFLOW_UI_URL"].rstrip("/")
    uri = deployment.mlflow_tracking_uri()
    return uri.rstrip("/") if uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"


def run_url(experiment_id: str, run_id: str) -> str:
    return f"{ui_base()}/#/experiments/{quote(str(experiment_id))}/runs/{quote(run_id)}"


def model_version_url(name: str, version: str) -> str:
    return f"{ui_base()}/#/models/{quote(name)}/versions/{quote(str(version))}"
