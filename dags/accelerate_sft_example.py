"""An Airflow DAG: a plain Accelerate fine-tuning script (examples/accelerate_sft.py), unchanged, on 2 ranks under
TorchrunOperator; its model folder is then registered (mlflow.transformers), evaluated and gated by the
llm_sft recipe's stages. Params as trl_sft_example's."""

from pipeline import deployment
from pipeline.airflow.script_dag import TRAIN_DATA, script_dag

dag = script_dag(
    "accelerate_sft_example",
    entry=[str(deployment.PROJECT_ROOT / "examples" / "accelerate_sft.py"), "--model", "{{ params.pretrained_path }}",
           "--data", TRAIN_DATA, "--epochs", "2"],
    param_defaults={"model_name": "accelerate_sft_example", "overrides": {"data.response_column": "completion"}},
    doc_md=__doc__,
)
