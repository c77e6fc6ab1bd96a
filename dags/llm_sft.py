"""The Airflow DAG of the causal-LM fine-tuning recipe: prompt/response or chat JSON Lines/Parquet -> tokenized
MDS -> a transformers model (full or LoRA) trained with torchrun DDP -> MLflow registry (transformers flavor) ->
evaluate (exact match, loss, perplexity, sample generations) -> (approve) -> promote."""

from pipeline.airflow.dag_factory import recipe_dag

dag = recipe_dag("llm_sft", doc_md=__doc__)
