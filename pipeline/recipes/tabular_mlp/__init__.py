"""Tabular MLP recipe: a multilayer perceptron over numeric and categorical columns, plain PyTorch DDP.

Light: no torch here; the model and hooks are in ``train.py``, imported by the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline import deployment
from pipeline.config import ModelConfig, PipelineConfig
from pipeline.config_fields import what_field
from pipeline.evaluate.directions import CLASSIFICATION
from pipeline.recipes.base import Recipe

NAME = "tabular_mlp"
DAILY_DATASET = f"{NAME}_daily"  # one version per day, prepared by the tabular_daily_prep DAG


@dataclass(kw_only=True)
class TabularModelConfig(ModelConfig):
    hidden_sizes: list[int] = what_field([128, 64], "Widths of the hidden layers.", min=1, max=8192)
    dropout: float = what_field(0.1, "Dropout after each hidden layer.", min=0.0, max=0.9)


@dataclass(kw_only=True)
class TabularConfig(PipelineConfig):
    METRICS = CLASSIFICATION
    RECIPE = NAME
    model: TabularModelConfig = field(default_factory=TabularModelConfig)


def daily_input_path() -> str:
    """The default input of the daily preparation: a folder of dt=YYYY-MM-DD/ partitions."""
    return str(deployment.raw_dir() / "tabular_daily")


dataset_uri = deployment.dataset_uri


def _write_demo(path) -> None:
    from pipeline.data import demo

    demo.write_parquet(path, 60_000)  # six numeric and three categorical features, three classes


RECIPE = Recipe(
    name=NAME,
    description="Multilayer perceptron on tabular rows (numeric and categorical features), plain PyTorch DDP.",
    config_class=TabularConfig,
    # 512 rows a step: below that, the DDP step's fixed cost on the CPU limits throughput, not the loader.
    defaults={"train.batch_size": 512},
    variants={
        "demo": {},
        "tiny": {
            "train.epochs": 3,
            "train.batch_size": 64,
            "model.hidden_sizes": [32, 16],
            "train.log_every_steps": 10,
            "data.shard_size_limit_bytes": 1 << 14,
        },
    },
    params={
        "input_path": "data.input_path",
        "label_column": "data.label_column",
        "hidden_sizes": "model.hidden_sizes",
        "parallelism": "train.parallelism",
    },
    train_spec="pipeline.recipes.tabular_mlp.train:SPEC",
    demo_path="tabular_demo.parquet",
    write_demo=_write_demo,
    tags=("ddp", "tabular"),
    prep_params=("input_path", "label_column", "overrides"),
)

# The recipe's functions, by the names the DAGs and tests use.
config = RECIPE.config
airflow_params = RECIPE.airflow_params
config_from_params = RECIPE.config_from_params
demo_input_path = RECIPE.demo_input_path
PREP_PARAMS = RECIPE.prep_params
