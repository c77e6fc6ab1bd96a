"""The "MLflow" button on the tasks whose result carries an ``mlflow_url`` (the run, the version, the report)."""

from __future__ import annotations

from airflow.sdk import BaseOperatorLink


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
