"""Admission by the run's own size through a real Airflow deployment: runs of `tabular_mlp` triggered over
the REST API (what the UI's trigger form does) get `train` task instances taking as many `gpu` pool slots
as their own ranks, and the scheduler admits by that: a 4-rank run waits in a 3-slot pool, then runs once
the pool has 4 slots.

Scheduler (LocalExecutor), dag-processor and api-server run as processes on a PostgreSQL metadata database
of their own, with this project's settings (the cluster policy comes from plugins/airflow_local_settings.py).
No training: the admitted task is marked failed as soon as it starts.
"""

from __future__ import annotations

import pytest

from tests.services import airflow_deployment, dag_parsed, wait_for

pytestmark = pytest.mark.e2e

DAG_ID = "tabular_mlp"


@pytest.fixture()
def deployment(tmp_path, monkeypatch):
    from pipeline import deployment

    monkeypatch.setenv("PIPELINE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("PIPELINE_TRAIN_POOL_SLOTS", raising=False)
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / f"{DAG_ID}.py").symlink_to(deployment.PROJECT_ROOT / "dags" / f"{DAG_ID}.py")
    with airflow_deployment(tmp_path, dags, monkeypatch, {"PIPELINE_TRAIN_POOL": "gpu"}) as api:
        yield api, tmp_path / "scheduler.log"


def _train(api, run_id: str) -> dict:
    return api.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/train")


def _train_state(api, run_id: str) -> str | None:
    """The train instance's state; None while the api-server is too busy to answer (a loaded machine)."""
    try:
        return _train(api, run_id)["state"]
    except OSError:
        return None


def test_a_run_is_admitted_by_its_own_ranks(deployment, demo_parquet):
    api, scheduler_log = deployment
    api.request("POST", "/api/v2/pools", {"name": "gpu", "slots": 3})
    wait_for(lambda: dag_parsed(api, DAG_ID), "the dag-processor to parse the DAG")
    conf = {"variant": "tiny", "input_path": str(demo_parquet)}
    big = api.request("POST", f"/api/v2/dags/{DAG_ID}/dagRuns",
                      {"logical_date": None, "conf": {**conf, "nproc_per_node": 4}})["dag_run_id"]
    default = api.request("POST", f"/api/v2/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": conf})["dag_run_id"]

    # The api-server created both runs' task instances (create_dagrun -> verify_integrity -> the policy).
    assert _train(api, big)["pool_slots"] == 4
    assert _train(api, default)["pool_slots"] == 2  # the tiny variant's default ranks
    assert _train(api, big)["pool"] == "gpu"

    # The scheduler admits by the row: 4 slots never fit a pool of 3 (2 would have).
    wait_for(lambda: _train_state(api, big) == "scheduled", "the 4-rank run's train to be scheduled", timeout_s=300)
    wait_for(lambda: "Requested pool slots (4) are greater than total pool slots: '3' for pool: gpu"
             in scheduler_log.read_text(), "the scheduler to refuse the 4-rank train in the 3-slot pool", timeout_s=60)
    assert _train(api, big)["state"] == "scheduled"

    api.request("PATCH", "/api/v2/pools/gpu?update_mask=slots", {"name": "gpu", "slots": 4, "include_deferred": False})
    wait_for(lambda: _train_state(api, big) in ("queued", "running"), "the 4-rank train to be admitted", timeout_s=120)
    api.request("PATCH", f"/api/v2/dags/{DAG_ID}/dagRuns/{big}/taskInstances/train", {"new_state": "failed"})
    assert _train(api, big)["pool_slots"] == 4
