"""The Airflow DAG of the two-tower recipe: interactions (user_id, item_id, timestamp, user and item
features) -> MDS split by time -> user and item towers trained by PyTorch Lightning's DDP under the
pipeline's torchrun launcher -> MLflow registry -> evaluate (recall@10/@50, NDCG@10, coverage, against
the most-popular baseline) -> (approve) -> promote."""

from pipeline.airflow.dag_factory import recipe_dag

dag = recipe_dag("two_tower", doc_md=__doc__)
