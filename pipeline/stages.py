"""The pipeline's stages. Each DAG task is one call to one of these functions.

Light at import (the DAG processor imports this module): torch, mlflow, pyarrow and streaming
are imported inside the functions that need them.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import settings
from pipeline.config import PipelineConfig
from pipeline.data import dataset_uris

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunInfo:
    """Which DAG run a stage works for: keys its MLflow run, model version and working folder."""

    dag_id: str
    run_id: str
    try_number: int = 1
    logical_date: str | None = None
    data_interval_start: str | None = None
    data_interval_end: str | None = None

    @property
    def key(self) -> str:
        return f"{self.dag_id}/{self.run_id}"

    @property
    def workdir(self) -> Path:
        return settings.runs_dir() / self.dag_id / re.sub(r"[^A-Za-z0-9._-]+", "_", self.run_id)

    @property
    def url(self) -> str:
        """The DAG run's page in the Airflow UI."""
        from urllib.parse import quote

        return f"{settings.airflow_base_url()}/dags/{quote(self.dag_id)}/runs/{quote(self.run_id, safe='')}"

    def tags(self) -> dict[str, str]:
        """Lineage tags shared by the MLflow run and the model version."""
        tags = {
            "airflow.dag_id": self.dag_id, "airflow.run_id": self.run_id, "airflow.try_number": str(self.try_number),
            "airflow.url": self.url,
        }
        for key in ("logical_date", "data_interval_start", "data_interval_end"):
            if getattr(self, key):
                tags[f"airflow.{key}"] = getattr(self, key)
        return tags


def lineage_tags(cfg: PipelineConfig, run: RunInfo, dataset: dict[str, Any]) -> dict[str, str]:
    from pipeline.registry.tracking import code_version

    return run.tags() | {
        "dataset.uri": dataset["uri"], "dataset.version": dataset["version"],
        "config.digest": cfg.digest(), "code.version": code_version(),
    }


def prepare_data(cfg: PipelineConfig, run: RunInfo, window: dict[str, str] | None = None) -> dict[str, Any]:
    """Publish (or find) the MDS dataset version of the configured input. A run that daily datasets
    triggered (``window``: the dataset and its newest interval's end) reads the newest
    ``data.window_intervals`` of them instead."""
    from pipeline.data import windows

    if window:
        dataset = windows.resolve(settings.data_dir(), window["dataset"], window["end"], cfg.data.window_intervals)
        log.info("training on the window %s of %s: versions %s", dataset["interval"], window["dataset"],
                 dataset["versions"])
        return dataset
    from pipeline.data.prep import prepare

    started = time.perf_counter()
    manifest = prepare(cfg.data, name=cfg.registry.model_name, out_root=settings.data_dir())
    return windows.summary(manifest, round(time.perf_counter() - started, 3))


def prepare_interval(cfg: PipelineConfig, run: RunInfo, name: str) -> dict[str, Any]:
    """Publish (or find) dataset ``name``'s version of the run's data interval (its input partitions)."""
    from pipeline.data import windows
    from pipeline.data.prep import prepare
    from pipeline.errors import ConfigError

    if not (run.data_interval_start and run.data_interval_end):
        raise ConfigError(f"DAG run {run.run_id} has no data interval: a per-interval dataset needs a scheduled "
                          f"run (or a backfill) of a DAG with a timetable")
    started = time.perf_counter()
    manifest = prepare(cfg.data, name=name, out_root=settings.data_dir(),
                       interval=(run.data_interval_start, run.data_interval_end))
    return windows.summary(manifest, round(time.perf_counter() - started, 3))


def train(cfg: PipelineConfig, run: RunInfo, dataset: dict[str, Any]) -> dict[str, Any]:
    """Launch torchrun over ``pipeline.train`` on this node; return rank 0's result."""
    from pipeline.launch.local import run_torchrun
    from pipeline.registry import tracking

    started = time.perf_counter()
    with tracking.reachable("create the MLflow run"):
        mlflow_run_id = tracking.ensure_run(cfg.registry.experiment, run.key, lineage_tags(cfg, run, dataset))
        tracking.log_params_once(mlflow_run_id, tracking.flatten(cfg.to_dict()) | {"launch.world_size": str(cfg.launch.nproc_per_node)})
        tracking.log_dataset_input(
            mlflow_run_id, name=cfg.registry.model_name, digest=dataset["version"], source_uri=dataset["uri"],
            profile={"rows": dataset["rows"]},
        )
    out_dir = run.workdir / "train"
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / "config.json"
    config_path.write_text(json.dumps(cfg.to_dict(), indent=2))
    result_path = out_dir / "result.json"
    result_path.unlink(missing_ok=True)  # never report a previous attempt's result
    datasets = dataset.get("uris") or [dataset["uri"]]
    launch = cfg.launch
    run_torchrun(
        ["-m", "pipeline.train", "--config", str(config_path), "--out", str(out_dir),
         *(arg for uri in datasets for arg in ("--dataset", uri))],
        nproc_per_node=launch.nproc_per_node,
        max_restarts=launch.max_restarts,
        # Checkpoints live in out_dir, keyed by DAG, run and task: a retry resumes where the last try stopped.
        log_dir=out_dir / f"logs-try{run.try_number}",
        # Rank 0 buffers and retries metrics itself: MLflow's own HTTP retries would stall a step.
        env={"MLFLOW_RUN_ID": mlflow_run_id, "MLFLOW_TRACKING_URI": settings.mlflow_tracking_uri(),
             "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"},
        timeout_s=launch.timeout_s,
        grace_period_s=launch.grace_period_s,
        stall_timeout_s=launch.stall_timeout_s or None,
    )
    from pipeline.registry.links import run_url

    result = json.loads(result_path.read_text())
    result["mlflow_experiment_id"] = tracking.experiment_id_of(mlflow_run_id)
    result["mlflow_url"] = run_url(result["mlflow_experiment_id"], mlflow_run_id)
    result["wall_s"] = round(time.perf_counter() - started, 3)
    return result


def register_model(cfg: PipelineConfig, run: RunInfo, dataset: dict[str, Any], trained: dict[str, Any]) -> dict[str, Any]:
    """Register the trained model once per DAG run and point ``challenger`` at it."""
    from pipeline.data.prep import PREPROCESSING
    from pipeline.data.reading import TrainingData
    from pipeline.registry import models, tracking
    from pipeline.registry.buffered import mlflow_sender, replay_spill

    started = time.perf_counter()
    # The model carries the preprocessing it was trained with: the merged one of every version read.
    data = TrainingData.open(dataset_uris(dataset), run.workdir / "register" / "cache")
    preprocessing_path = data.write_preprocessing(run.workdir / "register" / PREPROCESSING)
    with tracking.reachable("register the model"):
        replayed = replay_spill(Path(trained["unsent_metrics_path"]),
                                mlflow_sender(tracking.client(), trained["mlflow_run_id"]))
        if replayed:
            log.info("sent %d metric values that training could not deliver", replayed)
        version, created = models.log_and_register(
            run_id=trained["mlflow_run_id"],
            model_name=cfg.registry.model_name,
            run_key=run.key,
            model_path=trained["model_path"],
            spec=json.loads(Path(trained["spec_path"]).read_text()),
            preprocessing_path=str(preprocessing_path),
            input_example=data.sample_rows,
            tags=lineage_tags(cfg, run, dataset),
        )
        models.set_alias(cfg.registry.model_name, models.CHALLENGER, version)
    from pipeline.registry.links import model_version_url

    return {
        "model_name": cfg.registry.model_name,
        "version": version,
        "created": created,
        "mlflow_run_id": trained["mlflow_run_id"],
        "mlflow_experiment_id": trained["mlflow_experiment_id"],
        "mlflow_url": model_version_url(cfg.registry.model_name, version),
        "wall_s": round(time.perf_counter() - started, 3),
    }


def evaluate(cfg: PipelineConfig, run: RunInfo, dataset: dict[str, Any], registered: dict[str, Any]) -> dict[str, Any]:
    """Score challenger and champion on the same frozen test split, apply the gate, write the report."""
    import mlflow.pyfunc

    from pipeline.data.reading import TrainingData
    from pipeline.evaluate.gate import decide
    from pipeline.evaluate.metrics import classification_metrics
    from pipeline.evaluate.report import score_details, text_summary, write_report
    from pipeline.registry import models, tracking
    from pipeline.registry.links import run_url
    from pipeline.registry.model import PROBA_PREFIX

    started = time.perf_counter()
    name, run_id = cfg.registry.model_name, registered["mlflow_run_id"]
    # The test split of every version the model was trained on (a window's, or the one version's).
    data = TrainingData.open(dataset_uris(dataset), run.workdir / "evaluate" / "cache")
    frame, labels = data.frame("test")
    classes = data.preprocessing["label_classes"]
    scored: dict[str, dict[str, Any] | None] = {}
    with tracking.reachable("evaluate the registered models"):
        for alias in (models.CHALLENGER, models.CHAMPION):
            version = models.version_by_alias(name, alias)
            if version is None:
                scored[alias] = None
                continue
            out = mlflow.pyfunc.load_model(f"models:/{name}@{alias}").predict(frame)
            probabilities = out[[c for c in out.columns if c.startswith(PROBA_PREFIX)]].to_numpy()
            scored[alias] = {"version": str(version.version), "metrics": classification_metrics(labels, probabilities),
                             "details": score_details(labels, probabilities)}
        challenger, champion = scored[models.CHALLENGER], scored[models.CHAMPION]
        if challenger is None or challenger["version"] != registered["version"]:
            raise RuntimeError(f"alias {models.CHALLENGER!r} of {name} no longer points at version {registered['version']}")
        if champion is not None and champion["version"] == challenger["version"]:
            scored[models.CHAMPION] = champion = None  # a re-run of the run that made the champion
        decision = decide(cfg.evaluate, challenger["metrics"], champion["metrics"] if champion else None)

        mlflow_client = tracking.client()
        metrics = {f"test_{k}": v for k, v in challenger["metrics"].items()}
        if champion is not None:
            metrics |= {f"champion_test_{k}": v for k, v in champion["metrics"].items()}
        tracking.log_metrics_now(run_id, metrics)
        history = {key: [(m.step, m.value) for m in mlflow_client.get_metric_history(run_id, key)]
                   for key in ("train_loss", "val_loss", "train_accuracy", "val_accuracy")}
        report_dir = run.workdir / "evaluate" / "report"
        files = write_report(report_dir, model_name=name, classes=classes, scored=scored, history=history,
                             decision=decision.to_dict())
        for path in files:
            mlflow_client.log_artifact(run_id, str(path), artifact_path="evaluation")
        models.tag_version(name, registered["version"], decision.tags() | {
            f"test_{k}": round(v, 6) for k, v in challenger["metrics"].items()
        } | {"validation.test_rows": len(labels), "validation.dataset_version": dataset["version"]})
    log.info("evaluation of %s on %d test rows (dataset %s):\n%s", name, len(labels), dataset["version"],
             text_summary(classes, scored, decision.to_dict()))
    return {
        "challenger": {k: challenger[k] for k in ("version", "metrics")},
        "champion": {k: champion[k] for k in ("version", "metrics")} if champion else None,
        "gate": decision.to_dict(),
        "test_rows": int(len(labels)),
        "report": str(report_dir / "report.html"),
        "mlflow_url": run_url(registered["mlflow_experiment_id"], run_id) + "/artifacts/evaluation/report.html",
        "wall_s": round(time.perf_counter() - started, 3),
    }


def promote(
    cfg: PipelineConfig, run: RunInfo, dataset: dict[str, Any], trained: dict[str, Any],
    registered: dict[str, Any], evaluation: dict[str, Any], approval: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Move ``champion`` to the challenger when the gate (and, if required, a person) says so."""
    from pipeline.registry import models, tracking

    started = time.perf_counter()
    name, version = cfg.registry.model_name, registered["version"]
    gate = evaluation["gate"]
    promoted, reason = gate["passed"], f"gate {gate['status']}: {gate['reason']}"
    if promoted and cfg.evaluate.require_approval:
        chosen = (approval or {}).get("chosen_options") or ["Reject"]
        who = (approval or {}).get("responded_by_user") or "nobody (timed out)"
        if isinstance(who, dict):
            who = who.get("name") or who.get("id")
        promoted = chosen == ["Approve"]
        reason += f"; {'approved' if promoted else 'rejected'} by {who}"
    with tracking.reachable("move the champion alias"):
        current = models.version_by_alias(name, models.CHAMPION)
        if current is not None and str(current.version) == version:
            promoted, reason = True, "already the champion (a re-run of the DAG run that promoted it)"
        elif promoted:
            models.set_alias(name, models.CHAMPION, version)
        models.tag_version(name, version, {
            "promotion.decision": "promoted" if promoted else "rejected",
            "promotion.reason": reason,
            "promotion.compared_with": evaluation["champion"]["version"] if evaluation["champion"] else "none",
        })
        aliases = models.aliases(name, version)
    log.info("%s version %s %s: %s", name, version, "promoted to champion" if promoted else "not promoted", reason)
    summary = {
        "dag_id": run.dag_id,
        "run_id": run.run_id,
        "dataset": {"uri": dataset["uri"], "version": dataset["version"], "rows": dataset["rows"],
                    "reused": dataset["skipped"]},
        "model": {"name": name, "version": version, "aliases": aliases, "mlflow_run_id": registered["mlflow_run_id"]},
        "test_metrics": evaluation["challenger"]["metrics"],
        "champion_before": evaluation["champion"],
        "gate": gate,
        "promoted": promoted,
        "reason": reason,
        "report": evaluation["report"],
        "train": {"samples_per_s": trained["samples_per_s"], "world_size": trained["world_size"],
                  "backend": trained["backend"], "final_metrics": trained["metrics"]},
        "wall_s": {
            "prepare_data": dataset["wall_s"], "train": trained["wall_s"], "register_model": registered["wall_s"],
            "evaluate": evaluation["wall_s"], "promote": round(time.perf_counter() - started, 3),
        },
    }
    run.workdir.mkdir(parents=True, exist_ok=True)
    (run.workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
