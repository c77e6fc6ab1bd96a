"""Airflow plugin of the DDP pipelines: registers the "MLflow" operator extra link."""

from airflow.plugins_manager import AirflowPlugin

from pipeline.orchestration import MlflowLink


class PipelinePlugin(AirflowPlugin):
    name = "ddp_pipeline"
    operator_extra_links = [MlflowLink()]
