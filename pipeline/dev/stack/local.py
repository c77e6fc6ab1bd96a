"""The deployment's topology as local processes on 127.0.0.1, for machines without Docker.

``services`` (``make stack``): Airflow api-server, scheduler, dag-processor, triggerer and a Celery worker
on this machine's PostgreSQL and Redis, and an MLflow tracking server on PostgreSQL serving artifacts
from a local folder; the processes outlive the command, ``make stack-down`` ends them. With ``ray``
(``make stack RAY=1``), a Ray head (``pipeline.dev.stack.ray_head``) starts first and the Airflow services get
the ``ray_default`` connection to it. With ``s3`` (``make stack S3=1``), an S3 API server (moto's, as in the
tests; ``docker-compose.yml`` runs MinIO) starts first with the bucket ``pipeline``: the MLflow server proxies its
artifacts to ``s3://pipeline/mlflow``, the dataset versions go to ``s3://pipeline/datasets``, and the tasks get
the store's endpoint and key pair only through the ``aws_default`` connection.

``embedded`` (``make ui``): the embedded default (SQLite, LocalExecutor) with the same Airflow
components and an MLflow UI on the local store, in the foreground; Ctrl-C ends every process.

Each process starts in its own session; its pid is kept in ``<home>/stack.json``. Stopping marks
running task instances failed through the REST API (their task processes end), then signals every
process of every service, waits, and kills what remains. No component listens on another address
than 127.0.0.1: the log servers are not started (the api-server reads the log files directly).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import deployment
from pipeline.dev import s3_server
from pipeline.dev.s3_server import S3Server
from pipeline.dev.stack import secrets
from pipeline.dev.stack.processes import ended, stop_processes
from pipeline.dev.stack.rest import RestClient, fail_running_tasks, http_json
from pipeline.network import http_ok
from pipeline.registry.tracking_server import SERVER_ENV

SERVICES_MODE, EMBEDDED_MODE = "services", "embedded"
S3_BUCKET = "pipeline"  # the bucket of make stack S3=1, as docker-compose.yml's minio-init makes it


@dataclass
class LocalStack:
    home: Path
    mode: str = SERVICES_MODE
    airflow_port: int = 8080
    mlflow_port: int = 5000
    postgres: str = "postgresql://postgres@127.0.0.1:5432"
    redis: str = "redis://127.0.0.1:6379/0"
    db_prefix: str = "pipeline_stack"
    gpu_slots: int = 2
    worker_concurrency: int = 4
    ray: bool = False  # a Ray head (pipeline.dev.stack.ray_head) that the ray_default connection points at
    s3: bool = False  # an S3 API server with the bucket S3_BUCKET: MLflow's artifacts and the dataset versions
    s3_port: int = 9000
    extra_env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, mode: str = SERVICES_MODE) -> "LocalStack":
        """Settings from ``PIPELINE_STACK_*`` variables (home, ports, PostgreSQL, Redis, database prefix,
        ``gpu`` pool slots)."""
        env = os.environ
        return cls(
            home=Path(env.get("PIPELINE_STACK_HOME", deployment.home() / ("stack" if mode == SERVICES_MODE else "ui"))),
            mode=mode,
            airflow_port=int(env.get("PIPELINE_STACK_AIRFLOW_PORT", 8080)),
            mlflow_port=int(env.get("PIPELINE_STACK_MLFLOW_PORT", 5000)),
            s3_port=int(env.get("PIPELINE_STACK_S3_PORT", 9000)),
            postgres=env.get("PIPELINE_STACK_POSTGRES", cls.postgres),
            redis=env.get("PIPELINE_STACK_REDIS", cls.redis),
            db_prefix=env.get("PIPELINE_STACK_DB_PREFIX", cls.db_prefix),
            gpu_slots=int(env.get("PIPELINE_STACK_GPU_SLOTS", _gpu_count() or cls.gpu_slots)),
        )

    # -- where things are ------------------------------------------------------------------------

    @property
    def airflow_home(self) -> Path:
        return self.home / "airflow"

    @property
    def state_path(self) -> Path:
        return self.home / "stack.json"

    @property
    def airflow_url(self) -> str:
        return f"http://127.0.0.1:{self.airflow_port}"

    @property
    def mlflow_url(self) -> str:
        return f"http://127.0.0.1:{self.mlflow_port}"

    @property
    def s3_url(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def s3_keys(self) -> tuple[str, str]:
        """The store's key pair (moto takes any; MinIO's root user in docker-compose.yml)."""
        keys = self.secrets()
        return keys["MINIO_ROOT_USER"], keys["MINIO_ROOT_PASSWORD"]

    @property
    def passwords_path(self) -> Path:
        return self.airflow_home / "passwords.json"

    def database_url(self, purpose: str) -> str:
        return f"{self.postgres}/{self.db_prefix}_{purpose}"

    def admin_password(self) -> str:
        return self.secrets()["AIRFLOW_ADMIN_PASSWORD"]

    def secrets(self) -> dict[str, str]:
        """This stack's secrets (admin password, Fernet key, JWT secret), made once, mode 0600."""
        path = self.home / "secrets.env"
        secrets.write_env_file(path)
        return secrets.read_env_file(path)

    # -- what runs -------------------------------------------------------------------------------

    def environment(self) -> dict[str, str]:
        keys = self.secrets()
        env = {**os.environ, **deployment.airflow_env(self.airflow_home)}
        env.update({
            "AIRFLOW_HOME": str(self.airflow_home),
            "AIRFLOW__CORE__FERNET_KEY": keys["AIRFLOW_FERNET_KEY"],
            "AIRFLOW__API_AUTH__JWT_SECRET": keys["AIRFLOW_JWT_SECRET"],
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.airflow_port),
            "AIRFLOW__API__BASE_URL": self.airflow_url,
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.airflow_url}/execution/",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.passwords_path),
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
            "PIPELINE_MLFLOW_UI_URL": self.mlflow_url,
            **SERVER_ENV,  # the MLflow server without its server-side jobs
        })
        if self.mode == SERVICES_MODE:
            airflow_db = self.database_url("airflow")
            env.update({
                "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": airflow_db.replace("postgresql://", "postgresql+psycopg2://", 1),
                "AIRFLOW__CELERY__BROKER_URL": self.redis,
                "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + airflow_db,
                "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(self.worker_concurrency),
                # The worker imports torch, MLflow... once; the task processes it forks start with them.
                "AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS": "pipeline.airflow.preload.CELERY_CONFIG",
                # Tasks reach the tracking server through this connection, as in docker-compose.yml.
                "AIRFLOW_CONN_MLFLOW_DEFAULT": json.dumps({"conn_type": "http", "host": "127.0.0.1", "port": self.mlflow_port}),
                "PIPELINE_TRAIN_QUEUE": "gpu",
                "PIPELINE_TRAIN_POOL": "gpu",
                "PIPELINE_SWEEP_DB": self.database_url("sweeps").replace("postgresql://", "postgresql+psycopg2://", 1),
            })
            env.pop("MLFLOW_TRACKING_URI", None)
        if self.s3:  # the tasks reach the store through the connection, as they would a deployment's
            access_key, secret_key = self.s3_keys()
            env["AIRFLOW_CONN_AWS_DEFAULT"] = json.dumps({
                "conn_type": "aws", "login": access_key, "password": secret_key,
                "extra": {"endpoint_url": self.s3_url, "region_name": S3Server.REGION}})
            env["PIPELINE_DATA_DIR"] = f"s3://{S3_BUCKET}/datasets"
        env.update(self.extra_env)
        return env

    def commands(self) -> dict[str, list[str]]:
        airflow = [sys.executable, "-m", "airflow"]
        mlflow = [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1",
                  "--port", str(self.mlflow_port), "--workers", "1"]
        if self.mode == SERVICES_MODE:
            artifacts = f"s3://{S3_BUCKET}/mlflow" if self.s3 else str(self.home / "mlflow-artifacts")
            mlflow += ["--backend-store-uri", self.database_url("mlflow"), "--serve-artifacts",
                       "--artifacts-destination", artifacts,
                       "--allowed-hosts", f"127.0.0.1:{self.mlflow_port},localhost:{self.mlflow_port}"]
        else:  # the embedded default's store: what the tasks write to
            mlflow += ["--backend-store-uri", deployment.mlflow_tracking_uri(),
                       "--default-artifact-root", deployment.mlflow_artifact_root()]
        commands = {
            "api-server": [*airflow, "api-server", "--host", "127.0.0.1", "--port", str(self.airflow_port)],
            "scheduler": [*airflow, "scheduler", "--skip-serve-logs"],
            "dag-processor": [*airflow, "dag-processor"],
            "triggerer": [*airflow, "triggerer", "--skip-serve-logs"],
            "mlflow": mlflow,
        }
        if self.mode == SERVICES_MODE:
            commands["celery-worker"] = [*airflow, "celery", "worker", "--queues", "default,gpu",
                                         "--concurrency", str(self.worker_concurrency), "--skip-serve-logs"]
        return commands

    # -- starting --------------------------------------------------------------------------------

    def up(self, timeout_s: float = 240) -> dict:
        """Prepare the databases, start every process and wait until each is ready; returns the state."""
        if self.running():
            raise SystemExit(f"a stack already runs from {self.home} (pids in {self.state_path}); "
                             "stop it first (make stack-down)")
        self.home.mkdir(parents=True, exist_ok=True)
        self.airflow_home.mkdir(parents=True, exist_ok=True)
        env = self.environment()
        if self.mode == SERVICES_MODE:
            for purpose in ("airflow", "mlflow", "sweeps"):
                create_database(self.postgres, f"{self.db_prefix}_{purpose}")
        write_private(self.passwords_path, json.dumps({"admin": self.admin_password()}))
        log_dir = self.home / "logs"
        log_dir.mkdir(exist_ok=True)
        _run([sys.executable, "-m", "airflow", "db", "migrate"], env, log_dir / "init.log")
        _run([sys.executable, "-m", "airflow", "pools", "set", "gpu", str(self.gpu_slots),
              "GPUs of the training workers"], env, log_dir / "init.log")
        state = {"mode": self.mode, "home": str(self.home), "airflow_url": self.airflow_url,
                 "mlflow_url": self.mlflow_url, "pids": {}}
        try:
            if self.ray:  # first: the Airflow services start with the connection to it
                from pipeline.dev.stack import ray_head

                token = self.secrets()["RAY_AUTH_TOKEN"]
                address_file = self.home / "ray.json"
                address_file.unlink(missing_ok=True)
                # Every Ray job sees its cluster's environment: Airflow's settings and secrets stay out of it.
                head_env = {k: v for k, v in env.items() if not k.startswith("AIRFLOW")}
                self._start("ray-head", ray_head.command(address_file), {**head_env, "RAY_AUTH_TOKEN": token}, state)
                state["ray_address"] = ray_head.wait_address(
                    address_file, lambda: ended(state["pids"]["ray-head"]), timeout_s)
                env["AIRFLOW_CONN_RAY_DEFAULT"] = ray_head.connection(state["ray_address"], token)
            if self.s3:  # first: the MLflow server and the tasks need the bucket
                self._start("s3", s3_server.command(self.s3_port), env, state)
                s3_server.wait_answering(self.s3_url, lambda: ended(state["pids"]["s3"]),
                                         self.home / "logs" / "s3.log", timeout_s)
                s3_server.create_bucket(self.s3_url, *self.s3_keys(), S3_BUCKET)
                state["s3_url"] = self.s3_url
            for name, argv in self.commands().items():
                self._start(name, argv, self.mlflow_env(env) if name == "mlflow" else env, state)
            self.wait_ready(state, timeout_s)
        except BaseException:
            self.down()
            raise
        return state

    def mlflow_env(self, env: dict[str, str]) -> dict[str, str]:
        """The MLflow server's environment: the store's endpoint and key pair where it keeps artifacts on the store
        (the server alone holds them: clients download through it)."""
        if not self.s3:
            return env
        access_key, secret_key = self.s3_keys()
        return {**env, "MLFLOW_S3_ENDPOINT_URL": self.s3_url, "AWS_ACCESS_KEY_ID": access_key,
                "AWS_SECRET_ACCESS_KEY": secret_key, "AWS_DEFAULT_REGION": S3Server.REGION}

    def _start(self, name: str, argv: list[str], env: dict[str, str], state: dict) -> None:
        """Start one service in a session of its own, its output in ``logs/NAME.log``, its pid in the state."""
        with open(self.home / "logs" / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(self.home))
        state["pids"][name] = proc.pid
        write_private(self.state_path, json.dumps(state, indent=1))

    def wait_ready(self, state: dict, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        log_dir = self.home / "logs"
        pending = {"api-server", "mlflow", "scheduler", "dag-processor", "triggerer",
                   *(["celery-worker"] if self.mode == SERVICES_MODE else [])}
        while pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {timeout_s:.0f}s: {sorted(pending)}; see {log_dir}")
            for name, pid in state["pids"].items():
                if ended(pid):
                    raise RuntimeError(f"{name} exited while starting; see {log_dir / (name + '.log')}")
            if "mlflow" in pending and http_ok(f"{self.mlflow_url}/health"):
                pending.discard("mlflow")
            if "celery-worker" in pending and b" ready." in _read(log_dir / "celery-worker.log"):
                pending.discard("celery-worker")
            health = http_json(f"{self.airflow_url}/api/v2/monitor/health")
            if health:
                pending.discard("api-server")
                for name, key in (("scheduler", "scheduler"), ("dag-processor", "dag_processor"),
                                  ("triggerer", "triggerer")):
                    if (health.get(key) or {}).get("status") == "healthy":
                        pending.discard(name)
            time.sleep(1)

    def banner(self) -> str:
        return "\n".join([
            "",
            "=" * 72,
            f"Airflow UI  {self.airflow_url}   user admin   password {self.admin_password()}",
            f"MLflow UI   {self.mlflow_url}",
            *([f"Ray         {ray} (dashboard; RAY_AUTH_TOKEN in {self.home / 'secrets.env'})"]
              if (ray := (self.state() or {}).get("ray_address")) else []),
            *([f"S3          {s3} bucket {S3_BUCKET} (in memory: gone when the stack stops; keys in "
               f"{self.home / 'secrets.env'})"] if (s3 := (self.state() or {}).get("s3_url")) else []),
            f"logs        {self.home / 'logs'}",
            "stop        " + ("make stack-down" if self.mode == SERVICES_MODE else "Ctrl-C"),
            "DAGs start paused: unpause one in the UI (or PATCH /api/v2/dags/<id> is_paused=false) before"
            " its runs and backfills start.",
            "=" * 72,
        ])

    # -- stopping --------------------------------------------------------------------------------

    def state(self) -> dict | None:
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        state = self.state()
        return bool(state and any(not ended(pid) for pid in state["pids"].values()))

    def exited(self) -> list[str]:
        """The stack's services whose process is gone (each has its log in ``home/logs/NAME.log``)."""
        state = self.state() or {"pids": {}}
        return sorted(name for name, pid in state["pids"].items() if ended(pid))

    def down(self, grace_s: float = 15) -> list[int]:
        """Fail running tasks through the API, then end every process of the stack (signal each, wait,
        kill what remains). Returns the pids that had to be killed."""
        state = self.state()
        if not state:
            return []
        pids = state["pids"]
        if "api-server" in pids and not ended(pids["api-server"]):
            try:
                fail_running_tasks(self.client(), grace_s)
            except (OSError, ValueError, RuntimeError) as exc:
                print(f"could not mark running tasks failed through the API: {exc}", file=sys.stderr)
        killed = stop_processes(list(pids.values()), grace_s)
        self.state_path.unlink(missing_ok=True)
        return killed

    def client(self) -> "RestClient":
        return RestClient(self.airflow_url, "admin", self.admin_password())


def create_database(server: str, name: str) -> None:
    import psycopg2

    conn = psycopg2.connect(f"{server}/postgres", connect_timeout=5)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
        if cur.fetchone() is None:
            cur.execute(f'CREATE DATABASE "{name}"')
    conn.close()


def drop_database(server: str, name: str) -> None:
    import psycopg2

    conn = psycopg2.connect(f"{server}/postgres", connect_timeout=5)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    conn.close()


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600), replacing it whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(tmp, path)


def _gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return len([line for line in out.stdout.splitlines() if line.startswith("GPU ")]) if out.returncode == 0 else 0


def _run(argv: list[str], env: dict[str, str], log_path: Path) -> None:
    with open(log_path, "ab") as log:
        code = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if code:
        raise RuntimeError(f"{' '.join(argv[2:])} exited with {code}; see {log_path}")


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""
