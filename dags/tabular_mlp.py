"""Tabular MLP: Parquet -> MDS -> torchrun DDP -> MLflow registry -> evaluate -> (approve) -> promote."""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import Asset, Param, dag, task

from pipeline import settings, stages
from pipeline.data import windows
from pipeline.orchestration import promotion_approval, run_stage, with_mlflow_link
from pipeline.recipes import tabular_mlp as recipe

DATASET = Asset(name=recipe.NAME, uri=recipe.dataset_uri(recipe.NAME))
# Published by the tabular_daily_prep DAG; each of its events starts a run on the newest days.
DAILY = Asset(name=recipe.DAILY_DATASET, uri=recipe.dataset_uri(recipe.DAILY_DATASET))


@dag(
    dag_id=recipe.NAME,
    schedule=[DAILY],  # and by hand (input_path), from the UI or `airflow dags trigger`
    catchup=False,
    max_active_runs=1,
    # Retries are for infrastructure faults; a bad config or bad data fails at once (AirflowFailException).
    default_args={"retries": 2, "retry_delay": timedelta(seconds=settings.retry_delay_s())},
    tags=["ddp", "tabular"],
    params={name: Param(**schema) for name, schema in recipe.airflow_params().items()},
    doc_md=__doc__,
)
def tabular_mlp():
    @task(outlets=[DATASET])
    def prepare_data(*, triggering_asset_events=None, outlet_events=None) -> dict:
        window = windows.triggering_window(triggering_asset_events)
        dataset = run_stage(stages.prepare_data, recipe.config_from_params, window)
        outlet_events[DATASET].extra = windows.asset_extra(dataset)
        return dataset

    @task
    def train(dataset: dict) -> dict:
        return run_stage(stages.train, recipe.config_from_params, dataset)

    @task
    def register_model(dataset: dict, trained: dict) -> dict:
        return run_stage(stages.register_model, recipe.config_from_params, dataset, trained)

    @task
    def evaluate(dataset: dict, registered: dict) -> dict:
        return run_stage(stages.evaluate, recipe.config_from_params, dataset, registered)

    @task
    def promote(dataset: dict, trained: dict, registered: dict, evaluation: dict, approval: dict) -> dict:
        return run_stage(stages.promote, recipe.config_from_params, dataset, trained, registered, evaluation, approval)

    dataset = prepare_data()
    trained = with_mlflow_link(train(dataset))
    registered = with_mlflow_link(register_model(dataset, trained))
    evaluation = with_mlflow_link(evaluate(dataset, registered))
    approval = promotion_approval(retries=0)
    evaluation >> approval
    promote(dataset, trained, registered, evaluation, approval.output)


tabular_mlp()
