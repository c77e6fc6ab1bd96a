"""Glue between Airflow task bodies and the stages: the run's identity, config and error mapping."""

from __future__ import annotations

from typing import Any, Callable

from pipeline.config import PipelineConfig
from pipeline.errors import UserError
from pipeline.stages import RunInfo


def run_stage(stage: Callable[..., Any], config_from_params: Callable[[dict[str, Any]], PipelineConfig], *args: Any) -> Any:
    """Call ``stage(cfg, run, *args)`` for the current task instance.

    A ``UserError`` (bad config or data) becomes ``AirflowFailException``: retrying cannot fix it,
    so the task fails at once with the message that says what to change.
    """
    from airflow.sdk import get_current_context
    from airflow.sdk.exceptions import AirflowFailException

    context = get_current_context()
    ti = context["ti"]
    run = RunInfo(dag_id=ti.dag_id, run_id=ti.run_id, try_number=ti.try_number)
    try:
        cfg = config_from_params(dict(context["params"]))
        return stage(cfg, run, *args)
    except UserError as exc:
        raise AirflowFailException(f"{type(exc).__name__}: {exc}") from exc

