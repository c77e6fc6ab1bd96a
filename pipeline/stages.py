"""The pipeline's stages. Each DAG task is one call to one of these functions.

Light at import (the DAG processor imports this module): torch, mlflow, pyarrow and streaming
are imported inside the functions that need them.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from pipeline import settings
from pipeline.config import PipelineConfig
from pipeline.data import dataset_uris
from pipeline.run import RunInfo

__all__ = ["RunInfo", "prepare_data", "prepare_interval", "train", "register_model", "evaluate", "promote"]

log = logging.getLogger(__name__)


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
    manifest = prepare(cfg.data, name=cfg.RECIPE, out_root=settings.data_dir())
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
    """Run ``pipeline.train`` for the config's recipe on the configured launcher; return rank 0's result."""
    from pipeline.launch.spec import Job, JobSpec
    from pipeline.registry import tracking

    started = time.perf_counter()
    with tracking.reachable("create the MLflow run"):
        mlflow_run_id = tracking.ensure_run(cfg.registry.experiment, run.key, lineage_tags(cfg, run, dataset))
        tracking.log_params_once(mlflow_run_id, cfg.as_params() | {
            "recipe": cfg.RECIPE, "launch.world_size": str(cfg.launch.nnodes * cfg.launch.nproc_per_node)})
        tracking.log_dataset_input(
            mlflow_run_id, name=cfg.registry.model_name, digest=dataset["version"], source_uri=dataset["uri"],
            profile={"rows": dataset["rows"]},
        )
    # Keyed by DAG, run and task, not by try: a retry resumes from the checkpoints the last try left.
    spec = JobSpec(
        entry=["-m", "pipeline.train", "--recipe", cfg.RECIPE, "--config", str(run.job_dir("train") / "config.json"),
               "--out", str(run.job_dir("train")), *(arg for uri in dataset_uris(dataset) for arg in ("--dataset", uri))],
        job_dir=run.job_dir("train"), launch=cfg.launch, name=f"{run.dag_id}-train-{run.try_number}",
        try_number=run.try_number, labels={"dag_id": run.dag_id, "run_id": run.run_id, "task_id": "train",
                                           "try_number": str(run.try_number)},
        # Rank 0 buffers and retries metrics itself: MLflow's own HTTP retries would stall a step.
        env={"MLFLOW_RUN_ID": mlflow_run_id, "MLFLOW_TRACKING_URI": settings.mlflow_tracking_uri(),
             "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"},
    )
    spec.files.root.mkdir(parents=True, exist_ok=True)
    spec.files.config.write_text(json.dumps(cfg.to_dict(), indent=2))
    result = Job(spec).run(log.info)
    if result is None:
        raise RuntimeError(f"training ended without writing {spec.files.result}")
    from pipeline.registry.links import run_url

    result["mlflow_experiment_id"] = tracking.experiment_id_of(mlflow_run_id)
    result["mlflow_url"] = run_url(result["mlflow_experiment_id"], mlflow_run_id)
    result["wall_s"] = round(time.perf_counter() - started, 3)
    return result


def register_model(cfg: PipelineConfig, run: RunInfo, dataset: dict[str, Any], trained: dict[str, Any]) -> dict[str, Any]:
    """Register the trained model (the recipe's self-contained package) once per DAG run and point
    ``challenger`` at it."""
    from pipeline.data.reading import TrainingData
    from pipeline.registry import models, tracking
    from pipeline.registry.buffered import mlflow_sender, replay_spill

    started = time.perf_counter()
    spec = _train_spec(cfg)
    data = TrainingData.open(dataset_uris(dataset), run.workdir / "register" / "cache")
    with tracking.reachable("register the model"):
        replayed = replay_spill(Path(trained["unsent_metrics_path"]),
                                mlflow_sender(tracking.client(), trained["mlflow_run_id"]))
        if replayed:
            log.info("sent %d metric values that training could not deliver", replayed)
        version, created = models.log_and_register(
            run_id=trained["mlflow_run_id"], model_name=cfg.registry.model_name, run_key=run.key,
            package=spec.package(trained, data, cfg=cfg), tags=lineage_tags(cfg, run, dataset) | {"pipeline.recipe": cfg.RECIPE},
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
    """Score challenger and champion on the same frozen test split, apply the gate, write the report.

    A champion that takes other inputs (another recipe, another table's columns) is not comparable:
    the gate fails with that reason and the run goes on to ``promote``, which keeps the champion."""
    from pipeline.data.reading import TrainingData
    from pipeline.evaluate.gate import decide, not_comparable
    from pipeline.registry import models, tracking
    from pipeline.registry.links import run_url

    started = time.perf_counter()
    spec = _train_spec(cfg)
    evaluator = spec.evaluator
    name, run_id = cfg.registry.model_name, registered["mlflow_run_id"]
    # The test split of every version the model was trained on (a window's, or the one version's).
    data = TrainingData.open(dataset_uris(dataset), run.workdir / "evaluate" / "cache")
    inputs, labels = spec.evaluation_inputs(data, "test", cfg=cfg)
    classes = data.preprocessing.get("label_classes", [])
    with tracking.reachable("evaluate the registered models"):
        challenger_version = models.version_by_alias(name, models.CHALLENGER)
        if challenger_version is None or str(challenger_version.version) != registered["version"]:
            raise RuntimeError(f"alias {models.CHALLENGER!r} of {name} no longer points at version {registered['version']}")
        champion_version = models.version_by_alias(name, models.CHAMPION)
        if champion_version is not None and str(champion_version.version) == registered["version"]:
            champion_version = None  # a re-run of the run that made the champion
        scored: dict[str, dict[str, Any] | None] = {models.CHALLENGER: _score(
            evaluator, cfg, name, models.CHALLENGER, registered["version"], inputs, labels), models.CHAMPION: None}
        mismatch = None
        if champion_version is not None:
            mismatch = _input_mismatch(name, str(champion_version.version), registered["version"])
            if mismatch is None:
                scored[models.CHAMPION] = _score(evaluator, cfg, name, models.CHAMPION, str(champion_version.version),
                                                 inputs, labels)
        challenger, champion = scored[models.CHALLENGER], scored[models.CHAMPION]
        if mismatch:
            decision = not_comparable(mismatch)
        else:
            decision = decide(cfg.evaluate, challenger["metrics"], champion["metrics"] if champion else None,
                              evaluator.metrics)

        mlflow_client = tracking.client()
        metrics = {f"test_{k}": v for k, v in challenger["metrics"].items()}
        if champion is not None:
            metrics |= {f"champion_test_{k}": v for k, v in champion["metrics"].items()}
        tracking.log_metrics_now(run_id, metrics)
        history = {key: [(m.step, m.value) for m in mlflow_client.get_metric_history(run_id, key)]
                   for key in evaluator.history_keys}
        report_dir = run.workdir / "evaluate" / "report"
        files = evaluator.write_report(report_dir, model_name=name, classes=classes, scored=scored, history=history,
                                       decision=decision.to_dict())
        for path in files:
            mlflow_client.log_artifact(run_id, str(path), artifact_path="evaluation")
        models.tag_version(name, registered["version"], decision.tags() | {
            f"test_{k}": round(v, 6) for k, v in challenger["metrics"].items()
        } | {"validation.test_rows": len(labels), "validation.dataset_version": dataset["version"]})
    log.info("evaluation of %s on %d test rows (dataset %s):\n%s", name, len(labels), dataset["version"],
             evaluator.text_summary(classes, scored, decision.to_dict()))
    return {
        "challenger": {k: challenger[k] for k in ("version", "metrics")},
        "champion": {k: champion[k] for k in ("version", "metrics")} if champion else None,
        "champion_not_comparable": mismatch,
        "gate": decision.to_dict(),
        "test_rows": int(len(labels)),
        "report": str(report_dir / "report.html"),
        "mlflow_url": run_url(registered["mlflow_experiment_id"], run_id) + "/artifacts/evaluation/report.html",
        "wall_s": round(time.perf_counter() - started, 3),
    }


def _train_spec(cfg: PipelineConfig):
    from pipeline.recipes import get_recipe

    return get_recipe(cfg.RECIPE).load_train_spec()


def _score(evaluator, cfg: PipelineConfig, name: str, alias: str, version: str, inputs, labels) -> dict[str, Any]:
    """One registered version's metrics: its pyfunc's output scored by the evaluator, or, for an evaluator
    with ``score_model`` (a language model's loss needs the model itself), what that returns."""
    if hasattr(evaluator, "score_model"):
        return {"version": version, **evaluator.score_model(f"models:/{name}@{alias}", inputs, labels, cfg)}
    import mlflow.pyfunc

    output = mlflow.pyfunc.load_model(f"models:/{name}@{alias}").predict(inputs)
    return {"version": version, **evaluator.score(output, labels)}


def _input_mismatch(name: str, champion: str, challenger: str) -> str | None:
    """Why the champion cannot score the challenger's inputs, or None when both take the same ones."""
    from pipeline.registry import models

    theirs, ours = models.input_schema(name, champion), models.input_schema(name, challenger)
    if theirs == ours:
        return None
    describe = lambda schema: [c.get("name", c.get("type")) for c in schema or []]  # noqa: E731
    return (f"champion version {champion} takes inputs {describe(theirs)}, challenger version {challenger} "
            f"takes {describe(ours)}; the champion is kept (use another model_name to keep models of other "
            f"inputs apart)")


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
        "train": {"samples_per_s": trained.get("samples_per_s"), "world_size": trained["world_size"],
                  "backend": trained["backend"], "final_metrics": trained["metrics"],
                  **({"baseline_metrics": trained["baseline_metrics"]} if "baseline_metrics" in trained else {})},
        "wall_s": {
            "prepare_data": dataset["wall_s"], "train": trained["wall_s"], "register_model": registered["wall_s"],
            "evaluate": evaluation["wall_s"], "promote": round(time.perf_counter() - started, 3),
        },
    }
    run.workdir.mkdir(parents=True, exist_ok=True)
    (run.workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
