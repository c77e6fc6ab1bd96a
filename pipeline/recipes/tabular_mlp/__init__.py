"""Tabular MLP recipe: configs, and the Airflow Params that map onto them. Light: no torch here."""

from __future__ import annotations

from typing import Any

from pipeline import settings
from pipeline.config import PipelineConfig, param_schema

NAME = "tabular_mlp"
DAILY_DATASET = f"{NAME}_daily"  # one version per day, prepared by the tabular_daily_prep DAG

# Params form field -> config field. Only what a person triggering a run usually changes;
# everything else stays reachable through the config's defaults or the `overrides` Param.
PARAMS: dict[str, str] = {
    "input_path": "data.input_path",
    "label_column": "data.label_column",
    "nproc_per_node": "launch.nproc_per_node",
    "max_restarts": "launch.max_restarts",
    "epochs": "train.epochs",
    "batch_size": "train.batch_size",
    "learning_rate": "train.learning_rate",
    "hidden_sizes": "train.hidden_sizes",
    "seed": "train.seed",
    "checkpoint_every_steps": "train.checkpoint_every_steps",
    "require_approval": "evaluate.require_approval",
}


# The Params of a DAG that only prepares data.
PREP_PARAMS = ("input_path", "label_column", "overrides")


def demo_input_path() -> str:
    """Where `make demo` writes its generated Parquet file."""
    return str(settings.data_dir() / "raw" / "tabular_demo.parquet")


def daily_input_path() -> str:
    """The default input of the daily preparation: a folder of dt=YYYY-MM-DD/ partitions."""
    return str(settings.data_dir() / "raw" / "tabular_daily")


def dataset_uri(name: str) -> str:
    """The URI of a dataset's Airflow Asset: the folder its versions are published under."""
    return (settings.data_dir() / name).as_uri()


def config(variant: str = "default") -> PipelineConfig:
    """The recipe's config; ``tiny`` is what the tests run (a few seconds of training)."""
    base = PipelineConfig()
    base.data.input_path = demo_input_path()
    base.registry.model_name = NAME
    base.registry.experiment = NAME
    if variant == "default":
        return base
    if variant == "tiny":
        return base.with_overrides(
            {
                "train.epochs": 3,
                "train.batch_size": 64,
                "train.hidden_sizes": [32, 16],
                "train.log_every_steps": 10,
                "data.shard_size_limit_bytes": 1 << 14,
            }
        )
    raise ValueError(f"unknown variant {variant!r} of recipe {NAME}; expected 'default' or 'tiny'")


def airflow_params(only: tuple[str, ...] | None = None, **defaults: Any) -> dict[str, dict[str, Any]]:
    """JSON-schema keyword sets, one per Param (``only`` these), with defaults taken from the recipe's
    config unless given in ``defaults``."""
    flat = _flatten(config().to_dict())
    params = {name: param_schema(dotted, defaults.get(name, flat[dotted])) for name, dotted in PARAMS.items()}
    params["overrides"] = {
        "default": {},
        "type": "object",
        "description": 'Any other config field as SECTION.FIELD, e.g. {"train.dropout": 0.2, "evaluate.tolerance": 0.0}.',
    }
    return {name: schema for name, schema in params.items() if only is None or name in only}


def config_from_params(params: dict[str, Any]) -> PipelineConfig:
    """Build the run's config from the triggered Params (and the free-form ``overrides`` one)."""
    overrides = {PARAMS[name]: value for name, value in params.items() if name in PARAMS}
    overrides.update(params.get("overrides") or {})
    return config().with_overrides(overrides)


def _flatten(nested: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, fields in nested.items() for key, value in fields.items()}
