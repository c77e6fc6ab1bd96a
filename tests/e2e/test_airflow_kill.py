"""A running @task.torchrun task marked failed, then one cleared, through a real Airflow deployment.
The DAG and helpers serve the services stack's kill test too (tests/e2e/test_stack.py).

Scheduler (LocalExecutor), dag-processor and api-server run as processes on a PostgreSQL metadata
database of their own; the test drives them through the REST API like a user in the UI would.
"""

from __future__ import annotations

import textwrap
import time

import pytest

from pipeline.process_table import alive
from tests.processes import pids_with
from tests.services import AirflowApiServer, airflow_deployment
from tests.services import wait_for as _wait

pytestmark = pytest.mark.e2e

DAG_ID = "torchrun_kill"


KILL_DAG_SOURCE = textwrap.dedent(f'''
    from airflow.sdk import dag, task

    @dag(dag_id={DAG_ID!r}, schedule=None, catchup=False)
    def torchrun_kill():
        @task.torchrun(nproc_per_node=2, retries=0, grace_period_s=3)
        def sleep_long():
            import time
            time.sleep(600)

        sleep_long()

    torchrun_kill()
''')


def job_marker() -> str:
    """The job's command lines carry its folder (runs/<dag>/<run>/<task>/...): that finds its processes."""
    from pipeline import deployment

    return str(deployment.runs_dir() / DAG_ID) + "/"


@pytest.fixture()
def airflow(tmp_path, monkeypatch):
    """Airflow services on a fresh PostgreSQL database, with a DAG folder holding one sleeping job."""
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "torchrun_kill.py").write_text(KILL_DAG_SOURCE)
    with airflow_deployment(tmp_path, dags, monkeypatch) as api:
        yield api, job_marker()


def trigger_and_wait_for_ranks(api: AirflowApiServer, marker: str) -> tuple[str, set[int]]:
    def parsed():
        try:
            return api.request("GET", f"/api/v2/dags/{DAG_ID}")
        except OSError:
            return None

    _wait(parsed, "the dag-processor to parse the DAG")
    run = api.request("POST", f"/api/v2/dags/{DAG_ID}/dagRuns", {"logical_date": None})
    job = _wait(lambda: set(pids_with(marker)) if len(pids_with(marker)) >= 4 else None,
                "the guard, the torchrun agent and two ranks to run")
    return run["dag_run_id"], job


def _task_instance(api, run_id: str) -> dict:
    return api.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/sleep_long")


def still_alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if alive(pid)}


def test_marking_a_running_task_failed_or_clearing_it_stops_every_rank(airflow):
    api, marker = airflow

    run_id, job = trigger_and_wait_for_ranks(api, marker)
    api.request("PATCH", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/sleep_long", {"new_state": "failed"})
    marked = time.monotonic()
    _wait(lambda: not still_alive(job), "every process of the job to end after 'mark failed'", timeout_s=30)
    print(f"mark failed: {len(job)} processes of the job gone {time.monotonic() - marked:.1f}s later")
    assert _task_instance(api, run_id)["state"] == "failed"

    run_id, job = trigger_and_wait_for_ranks(api, marker)
    api.request("POST", f"/api/v2/dags/{DAG_ID}/clearTaskInstances",
                {"dag_run_id": run_id, "task_ids": ["sleep_long"], "dry_run": False, "only_failed": False})
    cleared = time.monotonic()
    _wait(lambda: not still_alive(job), "every process of the first try to end after 'clear'", timeout_s=30)
    print(f"clear: {len(job)} processes of the first try gone {time.monotonic() - cleared:.1f}s later")
