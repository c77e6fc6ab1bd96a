"""The services stack (``make stack``'s processes) for tests: one per test module, on a PostgreSQL
database pair and a Redis database of its own, on free ports, torn down with ``make stack-down``'s code."""

from __future__ import annotations

import json
import os
import random
import socket
import uuid
from pathlib import Path

from pipeline.dev.stack.local import LocalStack, drop_database
from tests.services import POSTGRES_DSN, free_port, service_missing

# Seen by the tasks only through the Airflow connection; must never show in a log.
MLFLOW_PASSWORD = "conn-secret-" + uuid.uuid4().hex
_CLAIM_KEY = "pipeline-test-stack-owner"
_CLAIM_S = 4 * 3600  # a claim outlives any stack test; one left by a killed session lapses


def make_stack(home: Path, dags: Path, env: dict[str, str] | None = None, gpu_slots: int = 1) -> LocalStack:
    import psycopg2
    import redis

    try:
        psycopg2.connect(f"{POSTGRES_DSN}/postgres", connect_timeout=5).close()
    except psycopg2.OperationalError as exc:
        service_missing(f"PostgreSQL at {POSTGRES_DSN}", exc)
    try:
        redis_url = claim_redis_db()
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


def claim_redis_db() -> str:
    """The URL of a Redis database (of 8-15) that no other stack uses, emptied of what an earlier one left.

    A stack's Celery broker must be its own: a worker of a concurrent test session on the same database would
    take this stack's tasks, and a stack torn down mid-task leaves its messages "unacked", which Celery hands
    to whichever worker uses that database a day later (their log paths are this stack's too, if the run ids
    match: a backfill's are by date). A key set only if absent claims a database until ``remove_stack``."""
    import redis

    owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    for db in random.sample(range(8, 16), 8):
        client = redis.Redis(host="127.0.0.1", port=6379, db=db, socket_connect_timeout=5)
        if client.set(_CLAIM_KEY, owner, nx=True, ex=_CLAIM_S):
            for key in client.scan_iter():
                if key != _CLAIM_KEY.encode():
                    client.delete(key)
            return f"redis://127.0.0.1:6379/{db}"
    raise AssertionError(f"Redis databases 8-15 are all claimed by running stacks ({_CLAIM_KEY} is set in each)")


def remove_stack(stack: LocalStack) -> None:
    import redis

    stack.down()
    for purpose in ("airflow", "mlflow", "sweeps"):
        drop_database(stack.postgres, f"{stack.db_prefix}_{purpose}")
    redis.Redis.from_url(stack.redis, socket_connect_timeout=5).flushdb()  # its messages and the claim
