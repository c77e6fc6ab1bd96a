"""The Airflow DAG of the image classifier recipe: IDX files or class folders of PNG/JPEG -> MDS -> a small
ResNet trained with torchrun DDP -> MLflow registry -> evaluate (accuracy, macro-F1, per-class F1, confusion
matrix) -> (approve) -> promote."""

from pipeline.airflow.dag_factory import recipe_dag

dag = recipe_dag("image_classifier", doc_md=__doc__)
