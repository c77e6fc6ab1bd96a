"""An Airflow DAG: LoRA fine-tuning with Axolotl (toolchains/axolotl/sft.py, Axolotl's own config in
toolchains/axolotl/sft.yaml) on 2 ranks under TorchrunOperator, in the axolotl toolchain's own environment
(Python 3.12; `make toolchain NAME=axolotl`); its adapter is then merged into the base model, registered
(mlflow.transformers), evaluated and gated by the llm_sft recipe's stages. Params as trl_sft_example's."""

from pipeline import deployment
from pipeline.airflow.script_dag import TRAIN_DATA, script_dag

dag = script_dag(
    "axolotl_sft_example",
    toolchain="axolotl",
    entry=[str(deployment.PROJECT_ROOT / "toolchains" / "axolotl" / "sft.py"), "--model", "{{ params.pretrained_path }}",
           "--data", TRAIN_DATA],
    param_defaults={"model_name": "axolotl_sft_example", "overrides": {"data.response_column": "completion"}},
    doc_md=__doc__,
)
