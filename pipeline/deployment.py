"""Where things live: every location comes from an environment variable with a project-local default."""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def home() -> Path:
    """Root of everything the pipeline writes (``PIPELINE_HOME``, default ``<project>/var``)."""
    return Path(os.environ.get("PIPELINE_HOME", PROJECT_ROOT / "var")).resolve()


def data_root() -> str:
    """Where MDS dataset versions are published (``PIPELINE_DATA_DIR``, default ``$PIPELINE_HOME/data``): a folder
    (an absolute path), or an object-store prefix such as ``s3://bucket/prefix`` (``pipeline.storage``)."""
    from pipeline import storage

    value = os.environ.get("PIPELINE_DATA_DIR")
    if value and storage.is_remote(value):
        return value.rstrip("/")
    return str(Path(value or home() / "data").resolve())


def raw_dir() -> Path:
    """Where the demos write their raw inputs: ``$PIPELINE_DATA_DIR/raw`` when it is a folder, else (versions on an
    object store) ``$PIPELINE_HOME/raw``."""
    from pipeline import storage

    root = data_root()
    return home() / "raw" if storage.is_remote(root) else Path(root) / "raw"


def runs_dir() -> Path:
    """Per-DAG-run working folders: configs, checkpoints, results (``PIPELINE_RUNS_DIR``)."""
    return Path(os.environ.get("PIPELINE_RUNS_DIR", home() / "runs")).resolve()


def staging_dir() -> Path:
    """A node-local folder for files on their way to or from an object store: a version converted before its upload,
    a checkpoint written before its upload or downloaded before a resume (``PIPELINE_STAGING_DIR``, default the
    system's temporary folder)."""
    import tempfile

    return Path(os.environ.get("PIPELINE_STAGING_DIR") or tempfile.gettempdir())


def job_store() -> str | None:
    """Where the job folders meet when a job's nodes share no folder (``PIPELINE_JOB_STORE``, an object-store prefix
    such as ``s3://bucket/jobs``; unset: the runs folder is on storage every node mounts). ``pipeline.job.mirror``."""
    return os.environ.get("PIPELINE_JOB_STORE") or None


def job_key(job_dir: Path | str) -> str:
    """A job's name on an object store, the same on every try: its folder's path under the runs folder
    (``DAG/RUN/TASK``), or for a folder elsewhere its name and a digest of its path."""
    import hashlib

    job_dir = Path(job_dir).resolve()
    try:
        return job_dir.relative_to(runs_dir()).as_posix()
    except ValueError:
        return f"{job_dir.name}-{hashlib.sha256(str(job_dir).encode()).hexdigest()[:8]}"


def retry_delay_s() -> float:
    """Wait before an Airflow retry of a failed task (``PIPELINE_RETRY_DELAY_S``, default 30)."""
    return float(os.environ.get("PIPELINE_RETRY_DELAY_S", 30))


def mlflow_tracking_uri() -> str:
    """MLflow tracking URI (``MLFLOW_TRACKING_URI``, default a SQLite file under ``$PIPELINE_HOME``)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{home() / 'mlflow' / 'mlflow.db'}"


def sweep_database() -> str:
    """SQLAlchemy URL of the sweeps' Optuna studies (``PIPELINE_SWEEP_DB``, default a SQLite file under
    ``$PIPELINE_HOME``; the services deployment's PostgreSQL has a ``sweeps`` database)."""
    return os.environ.get("PIPELINE_SWEEP_DB") or f"sqlite:///{home() / 'sweeps' / 'optuna.db'}"


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
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
    }
    env = {key: os.environ.get(key, value) for key, value in defaults.items()}
    # 64+ bytes, or Airflow signs tokens with a short ephemeral key; one random secret per home.
    env["AIRFLOW__API_AUTH__JWT_SECRET"] = os.environ.get("AIRFLOW__API_AUTH__JWT_SECRET") or jwt_secret(airflow_home)
    # DAG files, plugins and task processes import `pipeline` from the project root.
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([str(PROJECT_ROOT), *paths]))
    return env


def daily_start_date() -> str:
    """First day the daily preparation catches up from (``PIPELINE_DAILY_START_DATE``, ISO date)."""
    return os.environ.get("PIPELINE_DAILY_START_DATE", "2026-11-01")


def jwt_secret(airflow_home: Path) -> str:
    """The secret that signs this Airflow home's API tokens: 64 random bytes (hex), made once and kept in
    ``$AIRFLOW_HOME/jwt_secret`` (mode 0600). A fixed secret would let anyone sign an admin token."""
    import secrets

    path = Path(airflow_home) / "jwt_secret"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it first
            pass
        else:
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_hex(64))
    for _ in range(50):  # the process that created it may still be writing
        value = path.read_text().strip()
        if len(value) >= 128:
            return value
        import time

        time.sleep(0.02)
    raise RuntimeError(f"{path}: expected a JWT secret of 128 hex characters, found {len(value)}")


def train_queue() -> str:
    """Celery queue of training tasks (``PIPELINE_TRAIN_QUEUE``, default Airflow's ``default``): the GPU
    workers of a deployment serve it."""
    return os.environ.get("PIPELINE_TRAIN_QUEUE", "default")


def train_pool() -> str:
    """Airflow pool of training tasks (``PIPELINE_TRAIN_POOL``): ``gpu`` in a deployment, its slots the
    GPUs of the training workers; the embedded default admits through ``default_pool``."""
    return os.environ.get("PIPELINE_TRAIN_POOL", "default_pool")


def train_pool_slots(gpus: int) -> int:
    """Pool slots a training task takes: the GPUs it uses (``gpus``), or ``PIPELINE_TRAIN_POOL_SLOTS``.

    Read where a DAG is parsed (its default) and where a run's task instances are made (the run's own, by
    ``pipeline.airflow.admission`` in the api-server and scheduler): set the variable for every Airflow component."""
    return max(1, int(os.environ.get("PIPELINE_TRAIN_POOL_SLOTS", gpus)))


def apply_airflow_env(airflow_home: Path | None = None) -> dict[str, str]:
    """Put :func:`airflow_env` into ``os.environ`` (before anything imports airflow) and return it."""
    env = airflow_env(airflow_home)
    os.environ.update(env)
    Path(env["AIRFLOW_HOME"]).mkdir(parents=True, exist_ok=True)
    return env


def dataset_uri(name: str) -> str:
    """The URI of a dataset's Airflow Asset: the folder (or object-store prefix) its versions are published under."""
    from pipeline import storage

    root = data_root()
    return storage.join(root, name) if storage.is_remote(root) else (Path(root) / name).as_uri()
