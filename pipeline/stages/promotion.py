"""The promote stage: ``champion`` moves to the challenger when the gate (and, if required, a person) says so;
the run's summary is written either way."""

from __future__ import annotations

import json
import logging

from pipeline.config import PipelineConfig
from pipeline.results import (
    Approval,
    DatasetSummary,
    Evaluation,
    ModelSummary,
    PreparedData,
    Promotion,
    RegisteredModel,
    TrainedModel,
    TrainingSummary,
)
from pipeline.stages.run import RunInfo
from pipeline.stopwatch import Stopwatch

log = logging.getLogger(__name__)


def promote(
    cfg: PipelineConfig, run: RunInfo, dataset: PreparedData, trained: TrainedModel, registered: RegisteredModel,
    evaluation: Evaluation, approval: Approval | None = None,
) -> Promotion:
    """Move ``champion`` to the challenger when the gate (and, if required, a person) says so."""
    from pipeline.registry import models, tracking

    clock = Stopwatch()
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
                              final_metrics=trained.metrics, baseline_metrics=trained.baseline_metrics,
                              cost=trained.details.get("cost"), sweep=trained.details.get("sweep")),
        wall_s={
            "prepare_data": dataset.wall_s, "train": trained.wall_s, "register_model": registered.wall_s,
            "evaluate": evaluation.wall_s, "promote": clock.total(),
        },
    )
    run.workdir.mkdir(parents=True, exist_ok=True)
    (run.workdir / "summary.json").write_text(json.dumps(summary.to_xcom(), indent=2))
    return summary
