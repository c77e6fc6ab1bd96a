"""The daily preparation DAG under Airflow (dag.test): one dataset version per data interval, announced
as asset events with metadata; the training DAG is scheduled on that asset and reads the window."""

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from pipeline import deployment

DAYS = ["2026-11-26", "2026-11-27", "2026-11-28"]


@pytest.fixture(scope="module")
def daily_input(pipeline_home):
    from pipeline.data import demo

    root = pipeline_home / "inputs" / "daily"
    demo.write_partitions(root, DAYS, 400)
    return root


def _run(day: str, conf: dict):
    """A run for ``day``: a manual run covers the last complete interval before its logical date."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(deployment.PROJECT_ROOT / "dags" / "tabular_daily_prep.py"))
    after = datetime.fromisoformat(day).replace(tzinfo=timezone.utc) + timedelta(days=1)
    return bag.get_dag("tabular_daily_prep").test(logical_date=after, run_conf=conf)


@pytest.mark.slow  # three DAG runs through Airflow
def test_a_backfill_of_three_days_gives_three_versions_and_asset_events(airflow_db, daily_input):
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    from pipeline.data.versions import windows

    conf = {"input_path": str(daily_input), "overrides": {"data.shard_size_limit_bytes": 4096}}
    runs = [_run(day, conf) for day in DAYS]
    assert [str(getattr(r.state, "value", r.state)) for r in runs] == ["success"] * 3

    published = windows.published(Path(deployment.data_root()) / "tabular_mlp_daily")
    assert sorted(m["interval"]["start"][:10] for m in published) == DAYS
    assert len({m["version"] for m in published}) == 3
    assert all(sum(m["splits"].values()) == 400 for m in published)

    with create_session() as session:
        events = session.scalars(
            select(AssetEvent).join(AssetModel, AssetEvent.asset_id == AssetModel.id)
            .where(AssetModel.name == "tabular_mlp_daily").order_by(AssetEvent.id)
        ).all()
        extras = [e.extra for e in events]
    assert [x["version"] for x in extras[-3:]] == [m["version"] for m in sorted(published, key=lambda m: m["interval"]["start"])]
    assert all(sum(x["rows"].values()) == 400 and x["interval_start"] for x in extras[-3:])

    # Again for the same day: the version is found, not rebuilt, and the event says so.
    again = _run(DAYS[0], conf)
    assert str(getattr(again.state, "value", again.state)) == "success"
    assert len(windows.published(Path(deployment.data_root()) / "tabular_mlp_daily")) == 3

    # What an asset-triggered training run reads: the newest two days, as one window.
    window = windows.resolve(deployment.data_root(), "tabular_mlp_daily", extras[-1]["interval_end"], 2)
    assert list(window.versions) == [x["version"] for x in extras[-3:][1:]]
    assert sum(window.rows.values()) == 800


def test_the_training_dag_is_scheduled_on_the_daily_asset():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(deployment.PROJECT_ROOT / "dags"))
    training, prep = bag.dags["tabular_mlp"], bag.dags["tabular_daily_prep"]
    produced = prep.get_task("prepare_data").outlets
    consumed = training.timetable.asset_condition.objects
    assert [a.name for a in produced] == ["tabular_mlp_daily"]
    assert list(consumed) == list(produced)  # the same asset: name and URI
    assert [a.name for a in training.get_task("prepare_data").outlets] == ["tabular_mlp"]


def test_a_dag_the_metadata_db_does_not_know_is_not_paused(airflow_db):
    """The backfill warning (tests/unit/test_ui_fixes.py) asks the metadata DB; a DAG it has never seen is not
    paused."""
    from pipeline.dev import airflow_cli

    assert airflow_cli.is_paused("no_such_dag") is False
