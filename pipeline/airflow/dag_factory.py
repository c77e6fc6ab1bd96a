"""One DAG factory for every recipe: prepare_data -> train -> register_model -> evaluate -> approve -> promote.

The tasks after training (``release``) are shared with the DAGs around users' own scripts (``script_dag``).

A recipe's DAG file is one call: ``recipe_dag("image_classifier")``. Each task body is one call
into ``pipeline.stages`` through ``run_stage``, which builds the run's config from the Params form.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk import Asset, Param, dag, task

from pipeline import deployment, stages
from pipeline.airflow.approval import promotion_approval
from pipeline.airflow.links import with_mlflow_link
from pipeline.airflow.tasks import TrainOperator, run_stage
from pipeline.data.versions import windows
from pipeline.recipes import get_recipe


def recipe_dag(recipe_name: str, *, schedule: Any = None, doc_md: str | None = None, **dag_kwargs: Any):
    """The pipeline DAG of a registered recipe. ``schedule`` may be Assets of daily datasets: a run they
    trigger trains on the newest ``data.window_intervals`` of them (``pipeline.data.versions.windows``)."""
    recipe = get_recipe(recipe_name)
    config_from_params = recipe.config_from_params

    @dag(
        dag_id=recipe.name,
        schedule=schedule,  # and by hand, from the UI's Params form or `airflow dags trigger -c`
        catchup=False,
        max_active_runs=1,
        # Retries are for infrastructure faults; a bad config or bad data fails at once (AirflowFailException).
        default_args={"retries": 2, "retry_delay": timedelta(seconds=deployment.retry_delay_s())},
        tags=list(recipe.tags),
        params={name: Param(**schema) for name, schema in recipe.airflow_params().items()},
        doc_md=doc_md or recipe.description,
        **dag_kwargs,
    )
    def pipeline_dag():
        prepared = prepare_data(recipe)()
        trained = TrainOperator(task_id="train", recipe=recipe.name, prepared=prepared, **admission(recipe))
        release(config_from_params, prepared, with_mlflow_link(trained.output))

    return pipeline_dag()


def prepare_data(recipe):
    """The prepare_data task of ``recipe``'s DAGs: publishes the run's dataset version (its Asset's event)."""
    dataset = Asset(name=recipe.name, uri=deployment.dataset_uri(recipe.name))

    @task(task_id="prepare_data", outlets=[dataset])
    def prepare(*, triggering_asset_events=None, outlet_events=None) -> dict:
        window = windows.triggering_window(triggering_asset_events, deployment.data_root())
        prepared = run_stage(stages.prepare_data, recipe.config_from_params, window)
        outlet_events[dataset].extra = windows.asset_extra(prepared)
        return prepared

    return prepare


def admission(recipe) -> dict[str, Any]:
    """Admission by GPUs of a train task: the training workers' queue, and as many slots of the training pool as
    the run's ranks use (a deployment's `gpu` pool has one slot per GPU). Here the default config's: the cluster
    policy pipeline.airflow.admission sets each run's instance to its own Params and conf's."""
    launch = recipe.config().launch
    return {"queue": deployment.train_queue(), "pool": deployment.train_pool(),
            "pool_slots": deployment.train_pool_slots(launch.nproc_per_node * launch.nnodes)}


def release(config_from_params, prepared, trained) -> None:
    """The tasks after training, the same in every pipeline DAG: register_model -> evaluate -> approve ->
    promote, on the outputs of ``prepared`` and ``trained`` (inside a DAG definition)."""

    @task
    def register_model(prepared: dict, trained: dict) -> dict:
        return run_stage(stages.register_model, config_from_params, prepared, trained)

    @task
    def evaluate(prepared: dict, registered: dict) -> dict:
        return run_stage(stages.evaluate, config_from_params, prepared, registered)

    @task
    def promote(prepared: dict, trained: dict, registered: dict, evaluation: dict, approval: dict) -> dict:
        return run_stage(stages.promote, config_from_params, prepared, trained, registered, evaluation, approval)

    registered = with_mlflow_link(register_model(prepared, trained))
    evaluation = with_mlflow_link(evaluate(prepared, registered))
    approval = promotion_approval(retries=0)
    evaluation >> approval
    promote(prepared, trained, registered, evaluation, approval.output)
