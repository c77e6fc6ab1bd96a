"""An Airflow DAG: TRL's SFTTrainer script (examples/trl_sft.py), unchanged, on 2 ranks under TorchrunOperator; its model
folder is then registered (mlflow.transformers), evaluated and gated by the llm_sft recipe's stages.
Params: input_path (prompt/completion JSON Lines; the script trains on its train split), pretrained_path (a local model folder with its tokenizer),
tokenizer_path (the same folder)."""

from pipeline import deployment
from pipeline.airflow.script_dag import TRAIN_DATA, script_dag

dag = script_dag(
    "trl_sft_example",
    entry=[str(deployment.PROJECT_ROOT / "examples" / "trl_sft.py"), "--model", "{{ params.pretrained_path }}",
           "--data", TRAIN_DATA],
    param_defaults={"model_name": "trl_sft_example", "overrides": {"data.response_column": "completion"}},
    doc_md=__doc__,
)
