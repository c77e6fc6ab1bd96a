"""The services stack (``make stack``'s processes) for tests: one per test module, on a PostgreSQL
database pair and a Redis database of its own, on free ports, torn down with ``make stack-down``'s code."""

from __future__ import annotations

import json
import random
import uuid
from pathlib import Path

from pipeline.dev.stack.local import LocalStack, drop_database
from tests.services import POSTGRES_DSN, free_port, service_missing

# Seen by the tasks only through the Airflow connection; must never show in a log.
MLFLOW_PASSWORD = "conn-secret-" + uuid.uuid4().hex


def make_stack(home: Path, dags: Path, env: dict[str, str] | None = None, gpu_slots: int = 1) -> LocalStack:
    import psycopg2
    import redis

    try:
        psycopg2.connect(f"{POSTGRES_DSN}/postgres", connect_timeout=5).close()
    except psycopg2.OperationalError as exc:
        service_missing(f"PostgreSQL at {POSTGRES_DSN}", exc)
    redis_url = f"redis://127.0.0.1:6379/{random.randint(8, 15)}"
    try:
        redis.Redis.from_url(redis_url, socket_connect_timeout=5).ping()
    except redis.exceptions.RedisError as exc:
        service_missing("Redis at 127.0.0.1:6379", exc)
    stack = LocalStack(home=home, airflow_port=free_port(), mlflow_port=free_port(), postgres=POSTGRES_DSN,
                       redis=redis_url, db_prefix=f"pipeline_test_{uuid.uuid4().hex[:8]}", gpu_slots=gpu_slots,
                       worker_concurrency=4)
    stack.extra_env = {
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW_CONN_MLFLOW_DEFAULT": json.dumps({"conn_type": "http", "host": "127.0.0.1", "port": stack.mlflow_port,
                                                   "login": "pipeline", "password": MLFLOW_PASSWORD}),
        **(env or {}),
    }
    return stack


def remove_stack(stack: LocalStack) -> None:
    stack.down()
    for purpose in ("airflow", "mlflow"):
        drop_database(stack.postgres, f"{stack.db_prefix}_{purpose}")
