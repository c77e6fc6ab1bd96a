"""Real services for integration tests: PostgreSQL databases and `mlflow server` processes (the S3 API server is
``pipeline.dev.s3_server``, which the benchmarks start too)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from pipeline.registry.tracking_server import SERVER_ENV

POSTGRES_DSN = os.environ.get("PIPELINE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432")


def service_missing(what: str, exc: BaseException) -> None:
    """Fail when CI requires the services (PIPELINE_REQUIRE_SERVICES=1), else skip, saying which."""
    message = f"{what} is not reachable ({type(exc).__name__}: {exc})"
    if os.environ.get("PIPELINE_REQUIRE_SERVICES") == "1":
        pytest.fail(message + "; start it (see README, 'Tests') or unset PIPELINE_REQUIRE_SERVICES")
    pytest.skip(message)


class PostgresDatabase:
    """A database with a unique name, dropped on close."""

    def __init__(self):
        import psycopg2

        self.name = f"pipeline_test_{uuid.uuid4().hex[:10]}"
        try:
            conn = psycopg2.connect(f"{POSTGRES_DSN}/postgres", connect_timeout=5)
        except psycopg2.OperationalError as exc:
            service_missing(f"PostgreSQL at {POSTGRES_DSN}", exc)
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{self.name}"')
        conn.close()
        self.url = f"{POSTGRES_DSN}/{self.name}"

    def close(self) -> None:
        import psycopg2

        conn = psycopg2.connect(f"{POSTGRES_DSN}/postgres", connect_timeout=5)
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
        conn.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`mlflow server` on 127.0.0.1 in its own process group; stop() and start() again on the same port."""

    def __init__(self, backend_uri: str, artifacts: Path, workers: int = 1):
        self.backend_uri = backend_uri
        self.artifacts = artifacts
        self.workers = workers
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = artifacts.parent / f"mlflow-server-{self.port}.log"

    def start(self, timeout_s: float = 120) -> None:
        mlflow_bin = str(Path(sys.executable).with_name("mlflow"))
        cmd = [mlflow_bin, "server", "--backend-store-uri", self.backend_uri,
               "--artifacts-destination", str(self.artifacts), "--host", "127.0.0.1", "--port", str(self.port),
               "--workers", str(self.workers)]
        log = open(self.log_path, "a")
        # MLflow's own code only (no PYTHONPATH), without its server-side jobs, as the pipeline starts it.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | SERVER_ENV
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"mlflow server not healthy after {timeout_s}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=15)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)
        self.proc = None


class AirflowApiServer:
    """`airflow api-server` on 127.0.0.1 over this test session's metadata DB, everyone an admin."""

    def __init__(self, log_dir):
        self.port = free_port(); self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"api-server-{self.port}.log"; self.proc = None
    def start(self, timeout_s=120):
        env = {**os.environ, "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True", "AIRFLOW__API__BASE_URL": self.url}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-m", "airflow", "api-server", "--host", "127.0.0.1", "--port", str(self.port)],
                                     env=env, stdout=open(self.log_path, "a"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/api/v2/monitor/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("api-server not healthy")
    def request(self, method, path, payload=None):
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self._token()}"}
        data = json.dumps(payload).encode() if payload is not None else None
        req = urllib.request.Request(f"{self.url}{path}", data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or b"{}")
    def _token(self):
        req = urllib.request.Request(f"{self.url}/auth/token", data=b'{"username": "admin", "password": "unused"}', method="POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())["access_token"]
    def stop(self):
        if self.proc:
            os.killpg(self.proc.pid, signal.SIGKILL); self.proc = None


@contextlib.contextmanager
def airflow_deployment(tmp_path: Path, dags: Path, monkeypatch, env: dict[str, str] | None = None):
    """Scheduler (LocalExecutor), dag-processor and api-server as processes reading ``dags``, on a
    PostgreSQL metadata database of their own; yields the api-server. ``env`` adds settings."""
    database = PostgresDatabase()
    settings = {
        "AIRFLOW_HOME": str(tmp_path / "airflow"),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": database.url.replace("postgresql://", "postgresql+psycopg2://"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__PARALLELISM": "2",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_SEC": "1",
        **(env or {}),
    }
    for key, value in settings.items():
        monkeypatch.setenv(key, value)
    others: list[subprocess.Popen] = []
    api = AirflowApiServer(tmp_path)
    try:
        subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, stdout=subprocess.DEVNULL)
        monkeypatch.setenv("AIRFLOW__CORE__EXECUTION_API_SERVER_URL", f"{api.url}/execution/")
        api.start()
        others = [
            subprocess.Popen([sys.executable, "-m", "airflow", command], env=dict(os.environ),
                             stdout=open(tmp_path / f"{command}.log", "a"), stderr=subprocess.STDOUT,
                             start_new_session=True)
            for command in ("scheduler", "dag-processor")
        ]
        yield api
    finally:
        api.stop()
        for proc in others:
            _kill_tree(proc)
        database.close()


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a service and everything it started (task processes and their jobs included)."""
    from pipeline.process_table import descendants

    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=10)


def dag_parsed(api, dag_id: str) -> bool:
    """Whether the deployment's api-server knows ``dag_id`` yet (the dag-processor has parsed its file)."""
    try:
        api.request("GET", f"/api/v2/dags/{dag_id}")
        return True
    except OSError:
        return False


def wait_for(condition, what: str, timeout_s: float = 180, poll_s: float = 0.5):
    """``condition()``'s first truthy value; fails naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
