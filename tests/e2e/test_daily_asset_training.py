"""The daily preparation and the training it triggers, through a real Airflow deployment: the scheduler
catches up two past days of `tabular_daily_prep`, each publishes a version and an asset event, and
the scheduler starts `tabular_mlp` from those events; that run trains on the window of daily versions.

Scheduler (LocalExecutor), dag-processor and api-server run as processes on a PostgreSQL metadata
database of their own, with this project's two tabular DAG files.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from tests.services import airflow_deployment, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture()
def deployment(tmp_path, monkeypatch):
    from pipeline import deployment
    from pipeline.data import demo
    from pipeline.recipes import tabular_mlp

    monkeypatch.setenv("PIPELINE_DATA_DIR", str(tmp_path / "data"))  # versions of this deployment only
    today = datetime.now(timezone.utc).date()
    days = [str(today - timedelta(days=2)), str(today - timedelta(days=1))]
    demo.write_partitions(tabular_mlp.daily_input_path(), days, 800, seed=11)
    dags = tmp_path / "dags"
    dags.mkdir()
    for name in ("tabular_daily_prep.py", "tabular_mlp.py"):
        (dags / name).symlink_to(deployment.PROJECT_ROOT / "dags" / name)
    env = {
        "PIPELINE_DAILY_START_DATE": days[0],  # catchup: exactly the two days written above
        "PIPELINE_RETRY_DELAY_S": "1",
    }
    with airflow_deployment(tmp_path, dags, monkeypatch, env) as api:
        yield api, days


def _wait(condition, what: str):
    return wait_for(condition, what, timeout_s=420, poll_s=1)


def _runs(api, dag_id: str) -> list[dict]:
    try:
        runs = api.request("GET", f"/api/v2/dags/{dag_id}/dagRuns")["dag_runs"]
    except OSError:
        return []
    return sorted(runs, key=lambda r: r["run_after"])


def test_daily_versions_trigger_training_on_their_window(deployment):
    api, days = deployment

    prep_runs = _wait(lambda: (lambda r: r if len(r) == 2 and all(x["state"] == "success" for x in r) else None)(
        _runs(api, "tabular_daily_prep")), "two daily preparation runs to succeed")
    versions = [
        api.request("GET", f"/api/v2/dags/tabular_daily_prep/dagRuns/{r['dag_run_id']}/taskInstances/prepare_data"
                    f"/xcomEntries/return_value")["value"]
        for r in prep_runs
    ]
    assert [v["interval"]["start"][:10] for v in versions] == days

    def dataset_of(run: dict) -> dict:
        return api.request("GET", f"/api/v2/dags/tabular_mlp/dagRuns/{run['dag_run_id']}/taskInstances/"
                                  f"prepare_data/xcomEntries/return_value")["value"]

    def trained_on_both_days():
        runs = _runs(api, "tabular_mlp")
        failed = [r for r in runs if r["state"] == "failed"]
        assert not failed, f"tabular_mlp run failed: {failed}"
        done = [r for r in runs if r["run_type"] == "asset_triggered" and r["state"] == "success"]
        return next((r for r in done if len(dataset_of(r)["versions"]) == 2), None)

    # A run starts on the first day's event; the second day's event (during that run) starts another.
    run = _wait(trained_on_both_days, "a tabular_mlp run triggered by the daily asset to train on both days")
    dataset = dataset_of(run)
    assert dataset["versions"] == [v["version"] for v in versions]  # the window, oldest first
    assert dataset["name"] == "tabular_mlp_daily" and dataset["skipped"]
    assert dataset["rows"] == {s: sum(v["rows"][s] for v in versions) for s in ("train", "val", "test")}
    summary = api.request("GET", f"/api/v2/dags/tabular_mlp/dagRuns/{run['dag_run_id']}/taskInstances/"
                                 f"promote/xcomEntries/return_value")["value"]
    assert summary["dataset"]["version"] == dataset["version"]
    assert summary["test_metrics"]["rows"] == dataset["rows"]["test"]  # evaluated on both days' test splits
