"""Every test session writes under its own temporary PIPELINE_HOME (data, MLflow, Airflow)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

# Before anything imports airflow or reads the settings: the session's own home and Airflow DB.
_HOME = Path(tempfile.mkdtemp(prefix="pipeline-tests-"))
os.environ["PIPELINE_HOME"] = str(_HOME)
for key in ("PIPELINE_DATA_DIR", "PIPELINE_RUNS_DIR", "PIPELINE_MLFLOW_ARTIFACTS", "MLFLOW_TRACKING_URI", "AIRFLOW_HOME"):
    os.environ.pop(key, None)
for key in [k for k in os.environ if k.startswith("AIRFLOW__")]:
    os.environ.pop(key)

from pipeline import settings  # noqa: E402

settings.apply_airflow_env()


@pytest.fixture(scope="session")
def pipeline_home() -> Path:
    return _HOME


@pytest.fixture(scope="session")
def demo_parquet(pipeline_home: Path) -> Path:
    """A small demo dataset (6,000 rows) shared by the tests that only read it."""
    from pipeline.data import demo

    return demo.write_parquet(pipeline_home / "inputs" / "demo.parquet", 6_000, seed=1)


@pytest.fixture(scope="session")
def airflow_db(pipeline_home: Path) -> Path:
    """The session's Airflow metadata DB (SQLite under PIPELINE_HOME), migrated once."""
    from pipeline.dev.demo import migrate_airflow_db

    migrate_airflow_db()
    return pipeline_home / "airflow" / "airflow.db"


@pytest.fixture(autouse=True, scope="module")
def _release_streaming_shared_memory():
    """After each test module, close the shared memory its StreamingDatasets left open. streaming registers
    every block with ``atexit``, so in this long-lived process none is ever freed, and each new dataset
    attaches to every live prefix's block to pick its own: about 36 descriptors per data test early in a
    run, hundreds late, and a whole run reached the 20,000 allowed. (A task runs in a process of its own.)"""
    import atexit
    import gc

    yield
    memory = sys.modules.get("streaming.base.shared.memory")
    if memory is None:
        return
    for obj in gc.get_objects():
        if isinstance(obj, memory.SharedMemory):
            try:
                obj.cleanup()
            except (BufferError, OSError):  # still mapped by a live array: left to the exit handler
                continue
            atexit.unregister(obj.cleanup)
