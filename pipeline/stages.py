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

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunInfo:
    """Which DAG run a stage works for: keys its MLflow run, model version and working folder."""

    dag_id: str
    run_id: str
    try_number: int = 1

    @property
    def key(self) -> str:
        return f"{self.dag_id}/{self.run_id}"

    @property
    def workdir(self) -> Path:
        return settings.runs_dir() / self.dag_id / re.sub(r"[^A-Za-z0-9._-]+", "_", self.run_id)

    def tags(self) -> dict[str, str]:
        return {"airflow.dag_id": self.dag_id, "airflow.run_id": self.run_id}


def _local(uri: str) -> Path:
    return Path(uri.removeprefix("file://"))


def prepare_data(cfg: PipelineConfig, run: RunInfo) -> dict[str, Any]:
    """Publish (or find) the MDS dataset version for the configured input."""
    from pipeline.data.tabular import prepare

    started = time.perf_counter()
    manifest = prepare(cfg.data, name=cfg.registry.model_name, out_root=settings.data_dir())
    return {
        "uri": manifest["uri"],
        "version": manifest["version"],
        "rows": manifest["splits"],
        "skipped": manifest["skipped"],
        "wall_s": round(time.perf_counter() - started, 3),
    }


def train(cfg: PipelineConfig, run: RunInfo, dataset: dict[str, Any]) -> dict[str, Any]:
    """Launch torchrun over ``pipeline.train`` on this node; return rank 0's result."""
    from pipeline.launch.local import run_torchrun
    from pipeline.registry.tracking import ensure_run

    started = time.perf_counter()
    mlflow_run_id = ensure_run(
        cfg.registry.experiment, run.key,
        run.tags() | {"dataset.uri": dataset["uri"], "dataset.version": dataset["version"],
                      "config.digest": cfg.digest()},
    )
    out_dir = run.workdir / "train"
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / "config.json"
    config_path.write_text(json.dumps(cfg.to_dict(), indent=2))
    result_path = out_dir / "result.json"
    result_path.unlink(missing_ok=True)  # never report a previous attempt's result
    run_torchrun(
        "pipeline.train",
        ["--config", str(config_path), "--dataset", dataset["uri"], "--out", str(out_dir)],
        nproc_per_node=cfg.launch.nproc_per_node,
        log_dir=out_dir / f"torchrun-logs-try{run.try_number}",
        env={"MLFLOW_RUN_ID": mlflow_run_id, "MLFLOW_TRACKING_URI": settings.mlflow_tracking_uri()},
        timeout_s=cfg.launch.timeout_s,
        grace_period_s=cfg.launch.grace_period_s,
    )
    result = json.loads(result_path.read_text())
    result["wall_s"] = round(time.perf_counter() - started, 3)
    return result


def register_model(cfg: PipelineConfig, run: RunInfo, dataset: dict[str, Any], trained: dict[str, Any]) -> dict[str, Any]:
    """Register the trained model once per DAG run and point ``challenger`` at it."""
    from pipeline.data.tabular import PREPROCESSING, read_manifest
    from pipeline.registry import models

    started = time.perf_counter()
    dataset_dir = _local(dataset["uri"])
    version, created = models.log_and_register(
        run_id=trained["mlflow_run_id"],
        model_name=cfg.registry.model_name,
        run_key=run.key,
        model_path=trained["model_path"],
        spec=json.loads(Path(trained["spec_path"]).read_text()),
        preprocessing_path=str(dataset_dir / PREPROCESSING),
        input_example=read_manifest(dataset_dir)["sample_rows"],
        tags=run.tags() | {"dataset.uri": dataset["uri"], "dataset.version": dataset["version"],
                           "config.digest": cfg.digest()},
    )
    models.set_alias(cfg.registry.model_name, models.CHALLENGER, version)
    return {
        "model_name": cfg.registry.model_name,
        "version": version,
        "created": created,
        "mlflow_run_id": trained["mlflow_run_id"],
        "wall_s": round(time.perf_counter() - started, 3),
    }


def evaluate(cfg: PipelineConfig, run: RunInfo, dataset: dict[str, Any], registered: dict[str, Any]) -> dict[str, Any]:
    """Score the challenger and the current champion on the same test split."""
    import mlflow.pyfunc

    from pipeline.data.tabular import load_split
    from pipeline.evaluate.metrics import classification_metrics
    from pipeline.registry import models
    from pipeline.registry.model import PROBA_PREFIX
    from pipeline.registry.tracking import client

    started = time.perf_counter()
    name = cfg.registry.model_name
    frame, labels = load_split(_local(dataset["uri"]), "test", run.workdir / "evaluate" / "cache")
    scores: dict[str, dict[str, Any] | None] = {}
    for alias in (models.CHALLENGER, models.CHAMPION):
        version = models.version_by_alias(name, alias)
        if version is None:
            scores[alias] = None
            continue
        scored = mlflow.pyfunc.load_model(f"models:/{name}@{alias}").predict(frame)
        probabilities = scored[[c for c in scored.columns if c.startswith(PROBA_PREFIX)]].to_numpy()
        scores[alias] = {"version": str(version.version), "metrics": classification_metrics(labels, probabilities)}
        log.info("%s (version %s) on %d test rows: %s", alias, version.version, len(labels), scores[alias]["metrics"])
    challenger = scores[models.CHALLENGER]
    if challenger is None or challenger["version"] != registered["version"]:
        raise RuntimeError(f"alias {models.CHALLENGER!r} of {name} no longer points at version {registered['version']}")
    mlflow_client = client()
    metrics = {f"test_{k}": v for k, v in challenger["metrics"].items()}
    if scores[models.CHAMPION] is not None:
        metrics |= {f"champion_test_{k}": v for k, v in scores[models.CHAMPION]["metrics"].items()}
    for key, value in metrics.items():
        mlflow_client.log_metric(registered["mlflow_run_id"], key, value)
    models.tag_version(name, registered["version"], {f"test_{k}": round(v, 6) for k, v in challenger["metrics"].items()})
    return {
        "challenger": challenger,
        "champion": scores[models.CHAMPION],
        "test_rows": int(len(labels)),
        "wall_s": round(time.perf_counter() - started, 3),
    }


def promote(
    cfg: PipelineConfig, run: RunInfo, dataset: dict[str, Any], trained: dict[str, Any],
    registered: dict[str, Any], evaluation: dict[str, Any],
) -> dict[str, Any]:
    """Move ``champion`` to the challenger when the gate passes; record why either way."""
    from pipeline.evaluate.gate import decide
    from pipeline.registry import models

    started = time.perf_counter()
    name, version = cfg.registry.model_name, registered["version"]
    champion = evaluation["champion"]
    if champion is not None and champion["version"] == version:
        decision_promote, reason = True, "challenger is already the champion (re-run of the same DAG run)"
    else:
        decision = decide(cfg.evaluate.metric, evaluation["challenger"]["metrics"],
                          champion["metrics"] if champion else None, cfg.evaluate.tolerance)
        decision_promote, reason = decision.promote, decision.reason
    if decision_promote:
        models.set_alias(name, models.CHAMPION, version)
    models.tag_version(name, version, {
        "promotion.decision": "promoted" if decision_promote else "rejected",
        "promotion.reason": reason,
        "promotion.compared_with": champion["version"] if champion else "none",
    })
    log.info("%s version %s %s: %s", name, version, "promoted to champion" if decision_promote else "not promoted", reason)
    summary = {
        "dag_id": run.dag_id,
        "run_id": run.run_id,
        "dataset": {"uri": dataset["uri"], "version": dataset["version"], "rows": dataset["rows"],
                    "reused": dataset["skipped"]},
        "model": {"name": name, "version": version, "aliases": models.aliases(name, version),
                  "mlflow_run_id": registered["mlflow_run_id"]},
        "test_metrics": evaluation["challenger"]["metrics"],
        "champion_before": champion,
        "promoted": decision_promote,
        "reason": reason,
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
