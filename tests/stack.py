"""The services stack (``make stack``'s processes) for tests: one per test module, on a PostgreSQL
database pair and a Redis database of its own, on free ports, torn down with ``make stack-down``'s code; the
probe DAG of its pool test, and its REST client as the tests drive it."""

from __future__ import annotations

import json
import os
import random
import socket
import textwrap
import uuid
from pathlib import Path

from pipeline.dev.stack.local import LocalStack, drop_database
from tests.services import POSTGRES_DSN, free_port, service_missing, wait_for

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


# Training takes the `gpu` pool (1 slot here) on the `gpu` queue. Each task writes its start and end into a file;
# the two runs' preparations each wait there for the other's start, and a training holds its slot until the test
# writes its release file: what overlaps, and what does not, follows from those conditions, not from durations.
POOL_DAG_SOURCE = textwrap.dedent('''
    import json
    import sys
    import time

    from airflow.sdk import dag, task

    from pipeline import deployment

    WAIT_S = 300  # each wait's bound: the test fails on its own timeouts first

    @dag(dag_id="gpu_pool_probe", schedule=None, catchup=False, max_active_runs=4)
    def gpu_pool_probe():
        def mark(what, event):
            from airflow.sdk import get_current_context

            run_id = get_current_context()["run_id"]
            warm = "torch" in sys.modules  # nothing here imports it: the Celery worker did (pipeline.airflow.preload)
            with open(deployment.home() / "gpu_pool_probe.jsonl", "a") as f:
                f.write(json.dumps({"run": run_id, "task": what, "event": event, "time": time.time(), "warm": warm})
                        + "\\n")
            return run_id

        def until(condition, what):
            deadline = time.monotonic() + WAIT_S
            while not condition():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gave up waiting for {what}")
                time.sleep(0.1)

        def started(what):
            lines = (deployment.home() / "gpu_pool_probe.jsonl").read_text().splitlines()
            return {m["run"] for m in map(json.loads, lines) if (m["task"], m["event"]) == (what, "start")}

        @task
        def prepare():
            mark("prepare", "start")
            until(lambda: len(started("prepare")) >= 2, "another run's preparation to start beside this one")
            mark("prepare", "end")

        @task(queue=deployment.train_queue(), pool=deployment.train_pool(), pool_slots=deployment.train_pool_slots(1))
        def train():
            run_id = mark("train", "start")
            release = deployment.home() / f"gpu_pool_probe-release-{run_id}"
            until(release.exists, f"the test to write {release}")
            mark("train", "end")

        @task
        def evaluate():
            mark("evaluate", "start")
            mark("evaluate", "end")

        prepare() >> train() >> evaluate()

    gpu_pool_probe()
''')


def live_client(stack, make_client):
    """The stack's REST clients, each request failing at once when a service of the stack has died (with
    its log's tail), rather than a poll for a run's state timing out minutes later."""

    class LiveClient:
        def __init__(self):
            self.inner = make_client()

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def request(self, *args, **kwargs):
            gone = stack.exited()
            if gone:
                tails = {name: (stack.home / "logs" / f"{name}.log").read_text(errors="replace")[-2000:] for name in gone}
                raise AssertionError(f"stack service(s) {gone} died:\n" + "\n".join(f"--- {n}\n{t}" for n, t in tails.items()))
            return self.inner.request(*args, **kwargs)

    return LiveClient


def dag_ids(client) -> set[str]:
    return {d["dag_id"] for d in client.request("GET", "/api/v2/dags?limit=100")["dags"]}


def run_state(client, dag_id: str, run_id: str) -> str:
    return client.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")["state"]


def wait_run(client, dag_id: str, run_id: str, timeout_s: float = 300) -> str:
    state = wait_for(lambda: (lambda s: s if s in ("success", "failed") else None)(run_state(client, dag_id, run_id)),
                     f"{dag_id} run {run_id} to finish", timeout_s=timeout_s, poll_s=1)
    return state


def xcom(client, dag_id: str, run_id: str, task_id: str):
    return client.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}"
                                 f"/xcomEntries/return_value")["value"]


def unpause(client, dag_id: str) -> None:
    client.request("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})


def api_token(secret: str) -> str:
    """A token for the admin, signed with ``secret`` as the api-server signs its own."""
    from datetime import datetime, timedelta, timezone

    import jwt

    now = datetime.now(timezone.utc)
    claims = {"sub": "admin", "role": "ADMIN", "aud": "apache-airflow", "iat": now, "nbf": now,
              "exp": now + timedelta(hours=1)}
    return jwt.encode(claims, secret, algorithm="HS512")


def backfill_done(client, backfill_id) -> bool:
    backfill = client.request("GET", f"/api/v2/backfills/{backfill_id}")
    return backfill.get("completed_at") is not None
