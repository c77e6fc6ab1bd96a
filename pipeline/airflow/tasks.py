"""Glue between Airflow task bodies and the stages: the run's identity, config and error mapping."""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from pipeline.airflow.connections import (
    mlflow_connection,
    mlflow_env_from_connection,
    storage_connection,
    storage_env_from_connection,
)
from pipeline.airflow.operator import TorchrunOperator, user_errors_fail
from pipeline.config import PipelineConfig
from pipeline.results import Result, from_xcom_as
from pipeline.stages.run import RunInfo


def run_stage(stage: Callable[..., Any], config_from_params: Callable[[dict[str, Any]], PipelineConfig], *args: Any) -> Any:
    """Call ``stage(cfg, run, *args)`` for the current task instance.

    The XCom boundary: an argument whose parameter is annotated with a ``pipeline.results`` type is
    parsed from its XCom value (a wrong shape fails naming the field), and a result the stage returns
    goes back as its ``to_xcom()``. A ``UserError`` (bad config or data, a malformed input) becomes
    ``AirflowFailException``: retrying cannot fix it, so the task fails at once with the message that
    says what to change.
    """
    from airflow.sdk import get_current_context

    context = get_current_context()
    run = task_run(context)
    with user_errors_fail():
        cfg = config_from_params(dict(context["params"]))
        outcome = stage(cfg, run, *typed_args(stage, args))
    return outcome.to_xcom() if isinstance(outcome, Result) else outcome


def task_run(context) -> RunInfo:
    """The task's DAG run, with MLflow's logging routed into the task log and its connection's and the object
    store's settings in the environment (the ranks inherit them), once this process's warm-up has finished importing."""
    from pipeline.airflow import preload

    preload.settled()
    route_mlflow_logging()
    os.environ.update(mlflow_env_from_connection(mlflow_connection()))
    os.environ.update(storage_env_from_connection(storage_connection()))
    ti = context["ti"]
    return RunInfo(
        dag_id=ti.dag_id, run_id=ti.run_id, try_number=ti.try_number,
        **{key: _iso(context.get(key)) for key in ("logical_date", "data_interval_start", "data_interval_end")},
    )


class TrainOperator(TorchrunOperator):
    """The recipe DAGs' ``train`` task: trains the run's recipe on the run's own config, whose ``launch.*``
    decides where and how; with ``launch.kubernetes.deferrable`` it waits in the triggerer
    (``pipeline.airflow.deferred``) as ``TorchrunOperator`` does. The job and the result are
    ``stages.train_job`` and ``stages.trained_model``; ``prepared`` is the prepare_data task's output."""

    template_fields: Sequence[str] = ("prepared",)

    def __init__(self, *, recipe: str, prepared: Any, **kwargs: Any):
        super().__init__(entry=[], **kwargs)
        self.recipe, self.prepared = recipe, prepared

    @classmethod
    def get_serialized_fields(cls):
        # The serialized DAG keeps the recipe: the scheduler's admission policy sizes this task by the run's
        # config of that recipe (pipeline.airflow.admission), whatever the DAG is called.
        return super().get_serialized_fields() | {"recipe"}

    def _spec(self, context):
        from pipeline import stages
        from pipeline.recipes import get_recipe
        from pipeline.results import PreparedData

        run = task_run(context)
        cfg = get_recipe(self.recipe).config_from_params(dict(context["params"]))
        dataset = from_xcom_as(PreparedData, self.prepared, "train's argument 'prepared'")
        self.metrics_flush_timeout_s = cfg.train.metrics_flush_timeout_s
        return stages.train_job(cfg, run, dataset)

    def _result(self, context, spec, result, wall_s):
        from pipeline import stages

        return stages.trained_model(spec, result, wall_s).to_xcom()


def typed_args(stage: Callable[..., Any], args: tuple[Any, ...]) -> list[Any]:
    """``args`` (XCom values) for ``stage(cfg, run, *args)``, each converted by its parameter's annotation."""
    import inspect

    parameters = list(inspect.signature(stage, eval_str=True).parameters.values())[2:]
    return [from_xcom_as(p.annotation, value, f"{stage.__name__}'s argument {p.name!r}")
            for p, value in zip(parameters, args)]


def route_mlflow_logging() -> None:
    """MLflow's messages through Python logging at their own level (into the task log), not printed to
    stderr (which a task log shows as ERROR); no progress bars. Holds for this process and its children
    (the environment), and for an MLflow already imported (its logger loses its stderr handler)."""
    import logging
    import sys

    os.environ["MLFLOW_CONFIGURE_LOGGING"] = "false"
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    if "mlflow" in sys.modules:
        logger = logging.getLogger("mlflow")
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate = True
        logger.setLevel(logging.INFO)


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


