"""Daily tabular data: each day's input partition (`dt=YYYY-MM-DD/`) becomes its own MDS dataset
version, announced as an event of the `tabular_mlp_daily` Asset with its version and row counts.

The `tabular_mlp` training DAG is scheduled on that Asset and trains on the newest
`data.window_intervals` days. A backfill prepares one version per past day:
`airflow backfill create --dag-id tabular_daily_prep --from-date 2026-11-01 --to-date 2026-11-07`.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from airflow.sdk import Asset, CronDataIntervalTimetable, Param, dag, task

from pipeline import deployment, stages
from pipeline.airflow.tasks import run_stage
from pipeline.data.versions import windows
from pipeline.recipes import tabular_mlp as recipe

DAILY = Asset(name=recipe.DAILY_DATASET, uri=recipe.dataset_uri(recipe.DAILY_DATASET))


@dag(
    dag_id="tabular_daily_prep",
    # Data intervals, not trigger instants: each run covers [midnight, next midnight) of one day.
    schedule=CronDataIntervalTimetable("@daily", timezone="UTC"),
    # The first day to prepare (PIPELINE_DAILY_START_DATE, an ISO date): catchup runs every day since.
    start_date=datetime.fromisoformat(deployment.daily_start_date()).replace(tzinfo=timezone.utc),
    catchup=True,  # every past day gets its version, as a backfill would
    max_active_runs=1,  # each run already converts with data.workers processes
    default_args={"retries": 2, "retry_delay": timedelta(seconds=deployment.retry_delay_s())},
    tags=["data", "tabular"],
    params={
        name: Param(**schema)
        for name, schema in recipe.airflow_params(recipe.PREP_PARAMS, input_path=recipe.daily_input_path()).items()
    },
    doc_md=__doc__,
)
def tabular_daily_prep():
    @task(outlets=[DAILY])
    def prepare_data(*, outlet_events=None) -> dict:
        dataset = run_stage(stages.prepare_interval, recipe.config_from_params, recipe.DAILY_DATASET)
        outlet_events[DAILY].extra = windows.asset_extra(dataset)
        return dataset

    prepare_data()


tabular_daily_prep()
