"""Airflow plugin of the DDP pipelines: the "MLflow" operator extra link, the "Training job" view of a running
job on every task instance's page (``pipeline.airflow.job_view``, served by the API server), and the launch API
for DAG authors.

Airflow puts ``plugins/`` on ``sys.path``, so a DAG can ``from pipeline_plugin import TorchrunOperator,
torchrun_task``. Plugins cannot add TaskFlow decorators: ``@task.torchrun`` comes from this
package's ``apache_airflow_provider`` entry point (``pyproject.toml``).
"""

from airflow.plugins_manager import AirflowPlugin

from pipeline.airflow.job_view import EXTERNAL_VIEW, FASTAPI_APP
from pipeline.airflow.operator import TorchrunOperator, torchrun_task
from pipeline.airflow.links import MlflowLink

__all__ = ["PipelinePlugin", "TorchrunOperator", "torchrun_task"]


class PipelinePlugin(AirflowPlugin):
    name = "ddp_pipeline"
    operator_extra_links = [MlflowLink()]
    fastapi_apps = [FASTAPI_APP]
    external_views = [EXTERNAL_VIEW]
