"""The register_model stage: the trained model's self-contained package, registered once per DAG run, and the
``challenger`` alias pointed at it."""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.config import PipelineConfig
from pipeline.results import PreparedData, RegisteredModel, TrainedModel
from pipeline.stages.lineage import lineage_tags, train_spec
from pipeline.stages.run import RunInfo
from pipeline.stopwatch import Stopwatch

log = logging.getLogger(__name__)


def register_model(cfg: PipelineConfig, run: RunInfo, dataset: PreparedData, trained: TrainedModel) -> RegisteredModel:
    """Register the trained model (the recipe's self-contained package) once per DAG run and point
    ``challenger`` at it."""
    from pipeline.data.read.training_data import TrainingData
    from pipeline.registry import metrics_relay, models, tracking

    phases = Stopwatch()
    with phases("open data"):
        spec = train_spec(cfg)
        data = TrainingData.open(list(dataset.uris), run.workdir / "register" / "cache")
    with tracking.reachable("register the model"):
        if trained.metrics_path is not None:
            with phases("send metrics"):
                sent = metrics_relay.send_rest(Path(trained.metrics_path), trained.mlflow_run_id)
            if sent:
                log.info("sent %d metric values that training could not deliver", sent)
        with phases("package"):
            package = spec.package(cfg, trained, data)
        version, created = models.log_and_register(
            run_id=trained.mlflow_run_id, model_name=cfg.registry.model_name, run_key=run.key, package=package,
            tags=lineage_tags(cfg, run, dataset) | {"pipeline.recipe": cfg.RECIPE} | training_cost(trained), phases=phases,
        )
        with phases("alias"):
            models.set_alias(cfg.registry.model_name, models.CHALLENGER, version)
    from pipeline.registry.links import model_version_url

    log.info("register_model %s", phases.line())
    return RegisteredModel(
        model_name=cfg.registry.model_name, version=version, created=created, mlflow_run_id=trained.mlflow_run_id,
        mlflow_experiment_id=trained.mlflow_experiment_id,
        mlflow_url=model_version_url(cfg.registry.model_name, version), wall_s=phases.total(),
        phases=phases.seconds,
    )


def training_cost(trained: TrainedModel) -> dict[str, str]:
    """The version's tags of what training it cost (``cost.*``), where the job recorded it."""
    from pipeline.job.supervisor import run_tags

    return run_tags({"cost": trained.details.get("cost")})
