"""An Airflow DAG: LoRA fine-tuning with Unsloth (toolchains/unsloth/sft.py, config toolchains/unsloth/sft.yaml) on 2
ranks under TorchrunOperator, in the unsloth toolchain's own environment (`make toolchain NAME=unsloth`); its
adapter is then merged into the base model, registered (mlflow.transformers), evaluated and gated by the llm_sft
recipe's stages. Params as trl_sft_example's."""

from pipeline import deployment
from pipeline.airflow.script_dag import TRAIN_DATA, script_dag

dag = script_dag(
    "unsloth_sft_example",
    toolchain="unsloth",
    entry=[str(deployment.PROJECT_ROOT / "toolchains" / "unsloth" / "sft.py"), "--model", "{{ params.pretrained_path }}",
           "--data", TRAIN_DATA],
    param_defaults={"model_name": "unsloth_sft_example", "overrides": {"data.response_column": "completion"}},
    doc_md=__doc__,
)
