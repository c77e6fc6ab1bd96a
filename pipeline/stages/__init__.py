"""The pipeline's stages. Each DAG task is one call to one of these functions.

They take and return the typed results of ``pipeline.results``; ``pipeline.airflow.tasks.run_stage``
converts them from and to XCom by these functions' annotations.

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
from pipeline.evaluate.evaluator import Evaluator
from pipeline.phases import Phases
from pipeline.results import (
    Approval, DatasetSummary, Evaluation, Gate, ModelScore, ModelSummary, PreparedData, Promotion, RegisteredModel,
    TrainedModel, TrainingSummary,
)
from pipeline.stages.run import RunInfo

__all__ = ["RunInfo", "prepare_data", "prepare_interval", "train", "train_job", "trained_model", "register_model",
           "evaluate", "promote"]

log = logging.getLogger(__name__)


def lineage_tags(cfg: PipelineConfig, run: RunInfo, dataset: PreparedData) -> dict[str, str]:
    """What a model comes from, on its MLflow run and its registered version: the DAG run, the dataset version,
    the digest of what is trained (``PipelineConfig.what``: where it ran is not part of it) and the code."""
    from pipeline.registry.tracking import code_version

    return run.tags() | {
        "dataset.uri": dataset.uri, "dataset.version": dataset.version,
        "config.digest": cfg.digest(), "code.version": code_version(),
    }


def prepare_data(cfg: PipelineConfig, run: RunInfo, window: dict[str, str] | None = None) -> PreparedData:
    """Publish (or find) the MDS dataset version of the configured input. A run that daily datasets
    triggered (``window``: the dataset and its newest interval's end) reads the newest
    ``data.window_intervals`` of them instead."""
    from pipeline.data import windows

    if window:
        dataset = windows.resolve(settings.data_dir(), window["dataset"], window["end"], cfg.data.window_intervals)
        log.info("training on the window %s of %s: versions %s", dataset.interval, window["dataset"],
                 list(dataset.versions))
        return dataset
    from pipeline.data.prep import prepare

    started = time.perf_counter()
    manifest = prepare(cfg.data, name=cfg.RECIPE, out_root=settings.data_dir())
    return windows.summary(manifest, round(time.perf_counter() - started, 3))


def prepare_interval(cfg: PipelineConfig, run: RunInfo, name: str) -> PreparedData:
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


def train(cfg: PipelineConfig, run: RunInfo, dataset: PreparedData) -> TrainedModel:
    """Run ``pipeline.rank`` for the config's recipe on the configured place; return the trained model
    (rank 0's result file, with the MLflow run's address). The recipe DAGs' train task runs the same two
    halves around a deferral where the place allows it (``pipeline.airflow.tasks.TrainOperator``)."""
    from pipeline.job.supervisor import Job

    started = time.perf_counter()
    spec = train_job(cfg, run, dataset)
    result = Job(spec, metrics_flush_timeout_s=cfg.train.metrics_flush_timeout_s).run(log.info)
    return trained_model(spec, result, time.perf_counter() - started)


def train_job(cfg: PipelineConfig, run: RunInfo, dataset: PreparedData):
    """The run's training job (``JobSpec``): its MLflow run created once, tagged with the lineage and given
    what is trained as params, and what is trained written into the job folder, where the ranks read it.
    Where the job runs reaches the place through the ``JobSpec``, not the ranks' config file."""
    from pipeline.job.spec import JobSpec
    from pipeline.registry import tracking

    with tracking.reachable("create the MLflow run"):
        # The ranks asked for say where the run went, not what it trained: a tag of this run, outside the lineage.
        ranks = {"launch.world_size": str(cfg.launch.nnodes * cfg.launch.nproc_per_node)}
        mlflow_run_id = tracking.ensure_run(cfg.registry.experiment, run.key, lineage_tags(cfg, run, dataset) | ranks)
        tracking.log_params_once(mlflow_run_id, cfg.as_params())
        tracking.log_dataset_input(
            mlflow_run_id, name=cfg.registry.model_name, digest=dataset.version, source_uri=dataset.uri,
            profile={"rows": dataset.rows},
        )
    # Keyed by DAG, run and task, not by try: a retry resumes from the checkpoints the last try left.
    folder = run.job_dir("train")
    spec = JobSpec(
        entry=["-m", "pipeline.rank", "--config", str(folder / "config.json"),
               *(arg for uri in dataset.uris for arg in ("--dataset", uri))],
        job_dir=folder, launch=cfg.launch, name=f"{run.dag_id}-train-{run.try_number}",
        try_number=run.try_number, labels={"dag_id": run.dag_id, "run_id": run.run_id, "task_id": "train",
                                           "try_number": str(run.try_number)},
        # The run's id tells the task's metrics relay where rank 0's metrics go (pipeline.registry.relay).
        env={"MLFLOW_RUN_ID": mlflow_run_id, "MLFLOW_TRACKING_URI": settings.mlflow_tracking_uri()},
    )
    spec.files.root.mkdir(parents=True, exist_ok=True)
    spec.files.config.write_text(json.dumps(cfg.what(), indent=2))
    return spec


def trained_model(spec, result: dict[str, Any] | None, wall_s: float) -> TrainedModel:
    """The job's end as a ``TrainedModel``: rank 0's result file and the MLflow run's address."""
    from pipeline.registry import tracking
    from pipeline.registry.links import run_url

    if result is None:
        raise RuntimeError(f"training ended without writing {spec.files.result}")
    mlflow_run_id = spec.env["MLFLOW_RUN_ID"]
    experiment_id = tracking.experiment_id_of(mlflow_run_id)
    # Rank 0's result file: the contract's fields, and the rest (steps, resumed_from, throughput) as details.
    named = ("model_files", "metrics", "world_size", "backend", "dataset_version", "samples_per_s",
             "baseline_metrics")
    return TrainedModel.from_xcom({key: result[key] for key in named if key in result} | {
        "mlflow_run_id": mlflow_run_id, "mlflow_experiment_id": experiment_id, "metrics_path": str(spec.files.metrics),
        "mlflow_url": run_url(experiment_id, mlflow_run_id), "wall_s": round(wall_s, 3),
        "details": {k: v for k, v in result.items() if k not in named and k != "mlflow_run_id"},
    })


def register_model(cfg: PipelineConfig, run: RunInfo, dataset: PreparedData, trained: TrainedModel) -> RegisteredModel:
    """Register the trained model (the recipe's self-contained package) once per DAG run and point
    ``challenger`` at it."""
    from pipeline.data.reading import TrainingData
    from pipeline.registry import models, relay, tracking

    phases = Phases()
    with phases("open data"):
        spec = _train_spec(cfg)
        data = TrainingData.open(list(dataset.uris), run.workdir / "register" / "cache")
    with tracking.reachable("register the model"):
        if trained.metrics_path is not None:
            with phases("send metrics"):
                sent = relay.send_rest(Path(trained.metrics_path), trained.mlflow_run_id)
            if sent:
                log.info("sent %d metric values that training could not deliver", sent)
        with phases("package"):
            package = spec.package(cfg, trained, data)
        version, created = models.log_and_register(
            run_id=trained.mlflow_run_id, model_name=cfg.registry.model_name, run_key=run.key, package=package,
            tags=lineage_tags(cfg, run, dataset) | {"pipeline.recipe": cfg.RECIPE}, phases=phases,
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


def evaluate(cfg: PipelineConfig, run: RunInfo, dataset: PreparedData, registered: RegisteredModel) -> Evaluation:
    """Score challenger and champion on the same frozen test split, apply the gate, write the report.

    A champion that takes other inputs (another recipe, another table's columns) is not comparable:
    the gate fails with that reason and the run goes on to ``promote``, which keeps the champion."""
    from pipeline.data.reading import TrainingData
    from pipeline.evaluate.gate import decide, not_comparable
    from pipeline.evaluate.report import build_report, publish
    from pipeline.registry import models, tracking
    from pipeline.registry.links import run_url

    phases = Phases()
    with phases("open data"):
        spec = _train_spec(cfg)
        evaluator = spec.evaluator
        # The test split of every version the model was trained on (a window's, or the one version's).
        data = TrainingData.open(list(dataset.uris), run.workdir / "evaluate" / "cache")
        inputs, labels = spec.evaluation_inputs(cfg, data, "test")
        classes = data.preprocessing.get("label_classes", [])
    name, run_id, version = cfg.registry.model_name, registered.mlflow_run_id, registered.version
    with tracking.reachable("evaluate the registered models"):
        challenger_version = models.version_by_alias(name, models.CHALLENGER)
        if challenger_version is None or str(challenger_version.version) != version:
            raise RuntimeError(f"alias {models.CHALLENGER!r} of {name} no longer points at version {version}")
        champion_version = models.version_by_alias(name, models.CHAMPION)
        if champion_version is not None and str(champion_version.version) == version:
            champion_version = None  # a re-run of the run that made the champion
        with phases("scoring"):
            scored: dict[str, dict[str, Any] | None] = {models.CHALLENGER: _score(
                evaluator, cfg, name, models.CHALLENGER, version, inputs, labels), models.CHAMPION: None}
            mismatch = None
            if champion_version is not None:
                mismatch = _input_mismatch(name, str(champion_version.version), version)
                if mismatch is None:
                    scored[models.CHAMPION] = _score(evaluator, cfg, name, models.CHAMPION,
                                                     str(champion_version.version), inputs, labels)
        challenger, champion = scored[models.CHALLENGER], scored[models.CHAMPION]
        if mismatch:
            decision = not_comparable(mismatch)
        else:
            decision = decide(cfg.evaluate, challenger["metrics"], champion["metrics"] if champion else None,
                              evaluator.metrics)

        with phases("report"):
            mlflow_client = tracking.client()
            runs = {models.CHALLENGER: run_id} | ({models.CHAMPION: champion_version.run_id} if champion else {})
            history = {role: {key: [(m.step, m.value) for m in mlflow_client.get_metric_history(run, key)]
                              for key in evaluator.history_keys} for role, run in runs.items()}
            report = build_report(evaluator, model_name=name, classes=classes, scored=scored, history=history,
                                  decision=decision.to_dict(), logged=mlflow_client.get_run(run_id).data.metrics,
                                  facts=(f"{len(labels)} test rows of dataset version {dataset.version}",))
            report_dir = run.workdir / "evaluate" / "report"
            publish(report, report_dir, log_metrics=lambda metrics: tracking.log_metrics_now(run_id, metrics),
                    log_artifact=lambda path: mlflow_client.log_artifact(run_id, str(path),
                                                                          artifact_path="evaluation"))
        with phases("tags"):
            models.tag_version(name, version, decision.tags() | {
                f"test_{k}": round(v, 6) for k, v in challenger["metrics"].items()
            } | {"validation.test_rows": len(labels), "validation.dataset_version": dataset.version})
    log.info("evaluation of %s on %d test rows (dataset %s):\n%s", name, len(labels), dataset.version, report.text())
    log.info("evaluate %s", phases.line())
    return Evaluation(
        challenger=ModelScore(version=challenger["version"], metrics=challenger["metrics"]),
        champion=ModelScore(version=champion["version"], metrics=champion["metrics"]) if champion else None,
        champion_not_comparable=mismatch,
        gate=Gate(**decision.to_dict()),
        test_rows=int(len(labels)),
        report=str(report_dir / "report.html"),
        mlflow_url=run_url(registered.mlflow_experiment_id, run_id) + "/artifacts/evaluation/report.html",
        wall_s=phases.total(),
        phases=phases.seconds,
    )


def _train_spec(cfg: PipelineConfig):
    from pipeline.recipes import get_recipe

    return get_recipe(cfg.RECIPE).load_train_spec()


def _score(evaluator: Evaluator, cfg: PipelineConfig, name: str, alias: str, version: str, inputs,
           labels) -> dict[str, Any]:
    """One registered version's metrics and report details, as the evaluator scores the model it loads."""
    return {"version": version, **evaluator.score(f"models:/{name}@{alias}", inputs, labels, cfg)}


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
    cfg: PipelineConfig, run: RunInfo, dataset: PreparedData, trained: TrainedModel, registered: RegisteredModel,
    evaluation: Evaluation, approval: Approval | None = None,
) -> Promotion:
    """Move ``champion`` to the challenger when the gate (and, if required, a person) says so."""
    from pipeline.registry import models, tracking

    started = time.perf_counter()
    name, version = cfg.registry.model_name, registered.version
    gate = evaluation.gate
    promoted, reason = gate.passed, f"gate {gate.status}: {gate.reason}"
    if promoted and cfg.evaluate.require_approval:
        approval = approval or Approval(chosen_options=("Reject",), responded_by_user="nobody (timed out)")
        promoted = approval.approved
        reason += f"; {'approved' if promoted else 'rejected'} by {approval.responded_by_user}"
    with tracking.reachable("move the champion alias"):
        current = models.version_by_alias(name, models.CHAMPION)
        if current is not None and str(current.version) == version:
            promoted, reason = True, "already the champion (a re-run of the DAG run that promoted it)"
        elif promoted:
            models.set_alias(name, models.CHAMPION, version)
        models.tag_version(name, version, {
            "promotion.decision": "promoted" if promoted else "rejected",
            "promotion.reason": reason,
            "promotion.compared_with": evaluation.champion.version if evaluation.champion else "none",
        })
        aliases = models.aliases(name, version)
    log.info("%s version %s %s: %s", name, version, "promoted to champion" if promoted else "not promoted", reason)
    summary = Promotion(
        dag_id=run.dag_id,
        run_id=run.run_id,
        dataset=DatasetSummary(uri=dataset.uri, version=dataset.version, rows=dataset.rows, reused=dataset.skipped),
        model=ModelSummary(name=name, version=version, aliases=tuple(aliases), mlflow_run_id=registered.mlflow_run_id),
        test_metrics=evaluation.challenger.metrics,
        champion_before=evaluation.champion,
        gate=gate,
        promoted=promoted,
        reason=reason,
        report=evaluation.report,
        train=TrainingSummary(samples_per_s=trained.samples_per_s, world_size=trained.world_size, backend=trained.backend,
                              final_metrics=trained.metrics, baseline_metrics=trained.baseline_metrics),
        wall_s={
            "prepare_data": dataset.wall_s, "train": trained.wall_s, "register_model": registered.wall_s,
            "evaluate": evaluation.wall_s, "promote": round(time.perf_counter() - started, 3),
        },
    )
    run.workdir.mkdir(parents=True, exist_ok=True)
    (run.workdir / "summary.json").write_text(json.dumps(summary.to_xcom(), indent=2))
    return summary
