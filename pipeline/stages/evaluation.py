"""The evaluate stage: challenger and champion scored on the same frozen test split, the gate applied, the report
written."""

from __future__ import annotations

import logging
from typing import Any

from pipeline.config import PipelineConfig
from pipeline.evaluate.evaluator import Evaluator
from pipeline.results import Evaluation, Gate, ModelScore, PreparedData, RegisteredModel
from pipeline.stages.lineage import train_spec
from pipeline.stages.run import RunInfo
from pipeline.stopwatch import Stopwatch

log = logging.getLogger(__name__)


def evaluate(cfg: PipelineConfig, run: RunInfo, dataset: PreparedData, registered: RegisteredModel) -> Evaluation:
    """Score challenger and champion on the same frozen test split, apply the gate, write the report.

    A champion that takes other inputs (another recipe, another table's columns) is not comparable:
    the gate fails with that reason and the run goes on to ``promote``, which keeps the champion."""
    from pipeline.data.read.training_data import TrainingData
    from pipeline.evaluate.gate import decide, not_comparable
    from pipeline.evaluate.report import build_report, publish
    from pipeline.registry import models, tracking
    from pipeline.registry.links import run_url

    phases = Stopwatch()
    with phases("open data"):
        spec = train_spec(cfg)
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
            run_data = mlflow_client.get_run(run_id).data
            spent = run_data.tags.get("cost.summary")  # what training cost (the train stage's tags)
            report = build_report(evaluator, model_name=name, classes=classes, scored=scored, history=history,
                                  decision=decision.to_dict(), logged=run_data.metrics,
                                  facts=(f"{len(labels)} test rows of dataset version {dataset.version}",
                                         *([spent] if spent else [])))
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
