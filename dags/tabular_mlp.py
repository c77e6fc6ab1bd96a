"""Tabular MLP: Parquet -> MDS -> torchrun DDP -> MLflow registry -> evaluate -> (approve) -> promote.

Runs by hand (the Params form's `input_path`) and on every event of the `tabular_mlp_daily` Asset,
which the `tabular_daily_prep` DAG publishes: such a run trains on the newest days.
"""

from airflow.sdk import Asset

from pipeline import deployment
from pipeline.airflow.dag_factory import recipe_dag
from pipeline.recipes.tabular_mlp import DAILY_DATASET

DAILY = Asset(name=DAILY_DATASET, uri=deployment.dataset_uri(DAILY_DATASET))

dag = recipe_dag("tabular_mlp", schedule=[DAILY], doc_md=__doc__)
