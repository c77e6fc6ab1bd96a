"""The daily preparation and the training it triggers, through a real Airflow deployment: the scheduler
catches up two past days of `tabular_daily_prep`, each publishes a version and an asset event, and
the scheduler starts `tabular_mlp` from those events; that run trains on the window of daily versions.

Scheduler (LocalExecutor), dag-processor and api-server run as processes on a PostgreSQL metadata
database of their own, with this project's two tabular DAG files.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest

from tests.services import AirflowApiServer, PostgresDatabase

pytestmark = pytest.mark.e2e


@pytest.fixture()
def deployment(tmp_path, monkeypatch):
    from pipeline import settings
    from pipeline.data import demo
    from pipeline.recipes import tabular_mlp

    monkeypatch.setenv("PIPELINE_DATA_DIR", str(tmp_path / "data"))  # versions of this deployment only
    today = datetime.now(timezone.utc).date()
    days = [str(today - timedelta(days=2)), str(today - timedelta(days=1))]
    demo.write_partitions(tabular_mlp.daily_input_path(), days, 800, seed=11)
    dags = tmp_path / "dags"
    dags.mkdir()
    for name in ("tabular_daily_prep.py", "tabular_mlp.py"):
        (dags / name).symlink_to(settings.PROJECT_ROOT / "dags" / name)
    database = PostgresDatabase()
    env = {
        "AIRFLOW_HOME": str(tmp_path / "airflow"),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": database.url.replace("postgresql://", "postgresql+psycopg2://"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__PARALLELISM": "2",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_SEC": "1",
        "PIPELINE_DAILY_START_DATE": days[0],  # catchup: exactly the two days written above
        "PIPELINE_RETRY_DELAY_S": "1",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, stdout=subprocess.DEVNULL)
    api = AirflowApiServer(tmp_path)
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTION_API_SERVER_URL", f"{api.url}/execution/")
    api.start()
    others = [
        subprocess.Popen([sys.executable, "-m", "airflow", command], env=dict(os.environ),
                         stdout=open(tmp_path / f"{command}.log", "a"), stderr=subprocess.STDOUT, start_new_session=True)
        for command in ("scheduler", "dag-processor")
    ]
    try:
        yield api, days
    finally:
        api.stop()
        for proc in others:
            _stop(proc)
        database.close()


def _stop(proc: subprocess.Popen) -> None:
    import signal

    from pipeline.launch.guard import descendants

    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=10)


def _wait(condition, what: str, timeout_s: float = 420):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


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
