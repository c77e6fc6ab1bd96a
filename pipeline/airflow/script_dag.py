"""A DAG around a user's own training script, run unchanged by ``TorchrunOperator``: prepare_data ->
open_run -> train (the script on N ranks) -> adopt -> register_model -> evaluate -> approve -> promote.

The script reads the torchrun environment and writes its model folder; the DAG gives it the MLflow run
(``MLFLOW_RUN_ID``, which the HF Trainer's and Accelerate's MLflow integrations use), a checkpoint folder
that survives retries (``PIPELINE_CHECKPOINT_DIR``) and takes its result (``PIPELINE_RESULT_FILE``). The
recipe's preparation, package, evaluation and gate then treat that folder as the recipe's own model.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Sequence

from airflow.sdk import Param, dag, task

from pipeline import deployment, stages
from pipeline.airflow.dag_factory import release
from pipeline.airflow.links import with_mlflow_link
from pipeline.airflow.operator import TorchrunOperator
from pipeline.airflow.tasks import run_stage
from pipeline.recipes import get_recipe
from pipeline.stages import script as script_stages

_FROM_OPEN_RUN = "{{{{ ti.xcom_pull(task_ids='open_run')['{}'] }}}}"
# The train split as prompt/completion JSON Lines, for a script's data argument in ``entry``.
TRAIN_DATA = _FROM_OPEN_RUN.format("train_data")


def script_dag(dag_id: str, *, entry: Sequence[str], recipe_name: str = "llm_sft", no_python: bool = False,
               toolchain: str | None = None, nproc_per_node: int = 2, param_defaults: dict[str, Any] | None = None,
               doc_md: str | None = None, **dag_kwargs: Any):
    """``entry``, ``no_python`` and ``toolchain`` are TorchrunOperator's (``entry`` templated:
    ``{{ params.pretrained_path }}``, ``TRAIN_DATA``); the Params are the recipe's."""
    recipe = get_recipe(recipe_name)
    config_from_params = recipe.config_from_params

    @dag(
        dag_id=dag_id, schedule=None, catchup=False, max_active_runs=1,
        default_args={"retries": 2, "retry_delay": timedelta(seconds=deployment.retry_delay_s())},
        tags=[*recipe.tags, "script"],
        params={name: Param(**schema) for name, schema in recipe.airflow_params(**(param_defaults or {})).items()},
        doc_md=doc_md, **dag_kwargs,
    )
    def script_pipeline():
        @task
        def prepare_data() -> dict:
            return run_stage(stages.prepare_data, config_from_params)

        @task
        def open_run(prepared: dict) -> dict:
            return run_stage(script_stages.open_run, config_from_params, prepared)

        # Admitted as the recipe DAGs' train task: the training workers' queue and pool (pipeline.deployment),
        # one slot per rank. Its ranks are fixed here (the operator's launch), so these slots are every run's
        # (pipeline.airflow.admission leaves script DAGs alone).
        train = TorchrunOperator(
            task_id="train", entry=list(entry), no_python=no_python, toolchain=toolchain,
            nproc_per_node=nproc_per_node,
            queue=deployment.train_queue(), pool=deployment.train_pool(),
            pool_slots=deployment.train_pool_slots(nproc_per_node),
            env={key: _FROM_OPEN_RUN.format(key) for key in ("MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI")},
        )

        @task
        def adopt(prepared: dict, tracked: dict, script_result: dict | None) -> dict:
            return run_stage(script_stages.adopt, config_from_params, prepared, tracked, script_result)

        prepared = prepare_data()
        tracked = open_run(prepared)
        tracked >> train
        release(config_from_params, prepared, with_mlflow_link(adopt(prepared, tracked, train.output)))

    return script_pipeline()
