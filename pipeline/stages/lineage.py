"""What ties a model to what made it: the lineage tags of its MLflow run and registered version, and the recipe's
training spec the stages after training load."""

from __future__ import annotations

from pipeline.config import PipelineConfig
from pipeline.results import PreparedData
from pipeline.stages.run import RunInfo


def lineage_tags(cfg: PipelineConfig, run: RunInfo, dataset: PreparedData) -> dict[str, str]:
    """What a model comes from, on its MLflow run and its registered version: the DAG run, the dataset version,
    the digest of what is trained (``PipelineConfig.identity``: how and where it ran are not part of it) and the code."""
    from pipeline.registry.tracking import code_version

    return run.tags() | {
        "dataset.uri": dataset.uri, "dataset.version": dataset.version,
        "config.digest": cfg.digest(), "code.version": code_version(),
    }


def train_spec(cfg: PipelineConfig):
    from pipeline.recipes import get_recipe

    return get_recipe(cfg.RECIPE).load_train_spec()
