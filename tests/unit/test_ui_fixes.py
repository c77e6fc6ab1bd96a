"""What a new user hit with the embedded UI: a fixed JWT secret, a fresh home without the demo inputs, a backfill
of a paused DAG waiting in silence. (MLflow's INFO lines logged as errors: tests/integration/test_task_process.py.)"""

from __future__ import annotations

import stat
from datetime import date, timedelta

from pipeline import deployment
from pipeline.dev import airflow_cli


def test_jwt_secret_is_random_per_airflow_home_private_and_kept(tmp_path, monkeypatch):
    monkeypatch.delenv("AIRFLOW__API_AUTH__JWT_SECRET", raising=False)
    monkeypatch.delenv("AIRFLOW_HOME", raising=False)
    first = deployment.airflow_env(tmp_path / "one")["AIRFLOW__API_AUTH__JWT_SECRET"]
    assert len(first.encode()) >= 64 and "0" * 40 not in first
    path = tmp_path / "one" / "jwt_secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert deployment.airflow_env(tmp_path / "one")["AIRFLOW__API_AUTH__JWT_SECRET"] == first  # kept
    assert deployment.airflow_env(tmp_path / "two")["AIRFLOW__API_AUTH__JWT_SECRET"] != first
    monkeypatch.setenv("AIRFLOW__API_AUTH__JWT_SECRET", "x" * 80)
    assert deployment.airflow_env(tmp_path / "one")["AIRFLOW__API_AUTH__JWT_SECRET"] == "x" * 80


def test_demo_inputs_cover_the_daily_catch_up_and_are_written_once(tmp_path, monkeypatch):
    from pipeline.dev.demo import ensure_demo_inputs
    from pipeline.recipes import get_recipe

    monkeypatch.setenv("PIPELINE_DATA_DIR", str(tmp_path / "data"))
    start = date.today() - timedelta(days=3)
    monkeypatch.setenv("PIPELINE_DAILY_START_DATE", str(start))
    written = ensure_demo_inputs(rows_per_day=50)
    days = sorted(p.name for p in (tmp_path / "data" / "raw" / "tabular_daily").iterdir())
    assert days == [f"dt={start + timedelta(days=i)}" for i in range(4)]  # start through today
    assert get_recipe("tabular_mlp").demo_input_path() in written
    assert ensure_demo_inputs(rows_per_day=50) == []


def test_backfill_of_a_paused_dag_warns_and_names_the_catch_up(monkeypatch):
    monkeypatch.setattr(airflow_cli, "is_paused", lambda dag_id: dag_id == "tabular_daily_prep")
    monkeypatch.setenv("PIPELINE_DAILY_START_DATE", "2026-11-01")
    warning = airflow_cli.paused_backfill_warning(
        ["backfill", "create", "--dag-id", "tabular_daily_prep", "--from-date", "2026-11-20", "--to-date", "2026-11-22"])
    assert "tabular_daily_prep is paused" in warning and "dags unpause tabular_daily_prep" in warning
    assert "PIPELINE_DAILY_START_DATE=2026-11-01" in warning
    assert airflow_cli.paused_backfill_warning(["backfill", "create", "--dag-id=tabular_mlp"]) is None
    assert airflow_cli.paused_backfill_warning(["dags", "list"]) is None


def test_a_run_triggered_by_concurrent_daily_events_trains_on_the_window_ending_at_the_newest_day(tmp_path):
    """A 3-day backfill's events arrived within 0.2 s: the run consumed them and trained on the window
    ending at the middle day, and no run followed for the newest one."""
    import json
    import random
    from types import SimpleNamespace

    from pipeline.data.versions import windows

    days = ["2026-11-20", "2026-11-21", "2026-11-22", "2026-11-23"]
    events = []
    for version, (start, end) in enumerate(zip(days, days[1:])):
        interval = {"start": f"{start}T00:00:00+00:00", "end": f"{end}T00:00:00+00:00"}
        folder = tmp_path / "tabular_mlp_daily" / f"v{version}"
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text(json.dumps({"interval": interval, "version": f"v{version}"}))
        events.append(SimpleNamespace(extra={"dataset": "tabular_mlp_daily", "interval_end": interval["end"]}))
    newest = "2026-11-23T00:00:00+00:00"

    shuffled = random.Random(0).sample(events, 3)
    assert windows.triggering_window({"asset": shuffled}, tmp_path)["end"] == newest
    # The run was created between the events: it holds the first two only, and the third queues no run.
    assert windows.triggering_window({"asset": events[:2]})["end"] == "2026-11-22T00:00:00+00:00"
    assert windows.triggering_window({"asset": events[:2]}, tmp_path) == {"dataset": "tabular_mlp_daily", "end": newest}
    assert windows.triggering_window({}, tmp_path) is None  # a manual run prepares its own input
