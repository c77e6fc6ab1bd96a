"""An Airflow DAG: LoRA fine-tuning with LLM Foundry (toolchains/llm_foundry/sft.py runs LLM Foundry's own
train_from_yaml on its TrainConfig in toolchains/llm_foundry/sft.yaml) on 2 ranks under TorchrunOperator, in the
llm_foundry toolchain's own environment (torch 2.7, Composer 0.32, MLflow 2; `make toolchain NAME=llm_foundry`);
its adapter is then merged into the base model, registered (mlflow.transformers), evaluated and gated by the
llm_sft recipe's stages. Params as trl_sft_example's."""

from pipeline import deployment
from pipeline.airflow.script_dag import TRAIN_DATA, script_dag

dag = script_dag(
    "llm_foundry_example",
    toolchain="llm_foundry",
    entry=[str(deployment.PROJECT_ROOT / "toolchains" / "llm_foundry" / "sft.py"),
           "--model", "{{ params.pretrained_path }}", "--data", TRAIN_DATA],
    param_defaults={"model_name": "llm_foundry_example", "overrides": {"data.response_column": "completion"}},
    doc_md=__doc__,
)
