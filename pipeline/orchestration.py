"""Glue between Airflow task bodies and the stages: the run's identity, config and error mapping."""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from airflow.sdk import BaseOperatorLink

from pipeline.config import PipelineConfig
from pipeline.errors import InfraError, UserError
from pipeline.launch.operator import TorchrunOperator
from pipeline.results import Approval, Evaluation, Result, from_xcom_as
from pipeline.run import RunInfo


def run_stage(stage: Callable[..., Any], config_from_params: Callable[[dict[str, Any]], PipelineConfig], *args: Any) -> Any:
    """Call ``stage(cfg, run, *args)`` for the current task instance.

    The XCom boundary: an argument whose parameter is annotated with a ``pipeline.results`` type is
    parsed from its XCom value (a wrong shape fails naming the field), and a result the stage returns
    goes back as its ``to_xcom()``. A ``UserError`` (bad config or data, a malformed input) becomes
    ``AirflowFailException``: retrying cannot fix it, so the task fails at once with the message that
    says what to change.
    """
    from airflow.sdk import get_current_context
    from airflow.sdk.exceptions import AirflowFailException

    context = get_current_context()
    run = task_run(context)
    try:
        cfg = config_from_params(dict(context["params"]))
        outcome = stage(cfg, run, *typed_args(stage, args))
    except UserError as exc:
        raise AirflowFailException(f"{type(exc).__name__}: {exc}") from exc
    return outcome.to_xcom() if isinstance(outcome, Result) else outcome


def task_run(context) -> RunInfo:
    """The task's DAG run, with MLflow's logging routed into the task log and its connection's settings in
    the environment (the ranks inherit them)."""
    route_mlflow_logging()
    os.environ.update(mlflow_env_from_connection(_mlflow_connection()))
    ti = context["ti"]
    return RunInfo(
        dag_id=ti.dag_id, run_id=ti.run_id, try_number=ti.try_number,
        **{key: _iso(context.get(key)) for key in ("logical_date", "data_interval_start", "data_interval_end")},
    )


class TrainOperator(TorchrunOperator):
    """The recipe DAGs' ``train`` task: trains the run's recipe on the run's own config, whose ``launch.*``
    decides where and how; with ``launch.kubernetes.deferrable`` it waits in the triggerer
    (``pipeline.launch.deferred``) as ``TorchrunOperator`` does. The job and the result are
    ``stages.train_job`` and ``stages.trained_model``; ``prepared`` is the prepare_data task's output."""

    template_fields: Sequence[str] = ("prepared",)

    def __init__(self, *, recipe: str, prepared: Any, **kwargs: Any):
        super().__init__(entry=[], **kwargs)
        self.recipe, self.prepared = recipe, prepared

    def _spec(self, context):
        from pipeline import stages
        from pipeline.recipes import get_recipe
        from pipeline.results import PreparedData

        run = task_run(context)
        cfg = get_recipe(self.recipe).config_from_params(dict(context["params"]))
        dataset = from_xcom_as(PreparedData, self.prepared, "train's argument 'prepared'")
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


def _mlflow_connection():
    """The Airflow connection named by ``PIPELINE_MLFLOW_CONN_ID`` (default ``mlflow_default``), if any.

    Only a connection that does not exist falls back to the environment (or the local default); a
    lookup that fails (the API server or a secrets backend unreachable) is a retryable fault: silently
    using the local store instead would log and register into the wrong place."""
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    conn_id = os.environ.get("PIPELINE_MLFLOW_CONN_ID", "mlflow_default")
    try:
        return BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        return None
    except Exception as exc:
        raise InfraError(f"looking up the Airflow connection {conn_id!r} for MLflow failed: "
                         f"{type(exc).__name__}: {exc}") from exc


def mlflow_env_from_connection(conn) -> dict[str, str]:
    """MLflow's own environment variables from an Airflow connection (host, login/password or token).

    They reach the torchrun ranks by inheritance, never on a command line; Airflow masks the
    connection's password in task logs.
    """
    if conn is None or not conn.host:
        return {}
    host = conn.host if "://" in conn.host else f"{conn.schema or conn.conn_type or 'http'}://{conn.host}"
    env = {"MLFLOW_TRACKING_URI": f"{host}:{conn.port}" if conn.port else host}
    if conn.login:
        env["MLFLOW_TRACKING_USERNAME"] = conn.login
    if conn.password:
        env["MLFLOW_TRACKING_PASSWORD"] = conn.password
    token = (conn.extra_dejson or {}).get("token")
    if token:
        env["MLFLOW_TRACKING_TOKEN"] = token
    return env


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


def promotion_approval(*, task_id: str = "approve", evaluate_task_id: str = "evaluate", **kwargs: Any):
    """A human-in-the-loop step before ``promote``; it asks only when the run's
    ``require_approval`` Param is set and the gate passed, and otherwise answers itself."""
    from datetime import timedelta

    from airflow.providers.standard.operators.hitl import HITLOperator

    class PromotionApproval(HITLOperator):
        """Its XCom is an ``Approval``: its own answer, or the person's (``execute_complete``)."""

        def execute(self, context):
            if not context["params"].get("require_approval"):
                return Approval(chosen_options=("Approve",), responded_by_user="not required").to_xcom()
            evaluation = Evaluation.from_xcom(context["ti"].xcom_pull(task_ids=evaluate_task_id))
            gate, challenger = evaluation.gate, evaluation.challenger
            if not gate.passed:
                return Approval(chosen_options=("Reject",), responded_by_user="gate failed").to_xcom()
            self.body = (
                f"Challenger version {challenger.version} passed the gate: {gate.reason}.\n\n"
                f"Test metrics: " + ", ".join(f"{k} {v:.4f}" for k, v in challenger.metrics.items())
                + f"\n\nReport: {evaluation.report}"
            )
            return super().execute(context)

        def execute_complete(self, context, event):
            answer = super().execute_complete(context, event)
            who = answer.get("responded_by_user")  # {"id", "name"}; none when the timeout chose the defaults
            if isinstance(who, dict):
                who = who.get("name") or who.get("id")
            responded_at = answer.get("responded_at")
            return Approval(chosen_options=tuple(answer.get("chosen_options") or ("Reject",)),
                            responded_by_user=str(who or "nobody (timed out)"),
                            responded_at=getattr(responded_at, "isoformat", lambda: responded_at)()).to_xcom()

    return PromotionApproval(
        task_id=task_id,
        subject="Promote the challenger to champion?",
        options=["Approve", "Reject"],
        defaults=["Reject"],
        multiple=False,
        response_timeout=timedelta(hours=24),
        **kwargs,
    )


class MlflowLink(BaseOperatorLink):
    """"MLflow" button on a task whose result carries an ``mlflow_url`` (the run, version or report).

    Airflow 3 evaluates links in the worker when the task finishes and keeps the address as an XCom;
    the plugin in ``plugins/`` registers this class so the UI can show the button.
    """

    name = "MLflow"

    def get_link(self, operator, *, ti_key) -> str:
        result = ti_key.xcom_pull(task_ids=ti_key.task_id) if hasattr(ti_key, "xcom_pull") else None
        return result.get("mlflow_url", "") if isinstance(result, dict) else ""


def with_mlflow_link(output):
    """Give the task behind a TaskFlow ``output`` the MLflow link; returns ``output``."""
    output.operator.operator_extra_links = [*output.operator.operator_extra_links, MlflowLink()]
    return output
