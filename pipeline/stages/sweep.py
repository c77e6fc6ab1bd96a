"""A sweep's stages, around the train stage: ``plan_sweep`` (the study and the MLflow parent run, once per DAG run),
``start_trial`` / ``trial_job`` (a slot's trial and its training job), ``trial_completed`` / ``trial_pruned`` /
``trial_failed`` (what the study and MLflow record of its end), and ``best_trial`` (the winner, which then goes
through register_model, evaluate, the gate and promote as a normal run's model).

The rule for failures: a trial that fails (a user error of its params, or a fault past its retries) fails only
itself; the sweep goes on with the trials that completed, and fails only when none did.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from pipeline.config import PipelineConfig
from pipeline.errors import ConfigError
from pipeline.results import PreparedData, TrainedModel
from pipeline.stages.run import RunInfo
from pipeline.stages.training import train_job
from pipeline.sweep.study import OUTCOME, SLOT, Sweep

log = logging.getLogger(__name__)

PARENT_RUN = "mlflow_run_id"  # the study's user attribute naming the sweep's MLflow parent run
STATE_TAG = "sweep.trial_state"  # complete, pruned, failed (running while it trains)
ERROR = "error"  # a failed trial's user attribute: what it failed on


@dataclass
class SlotTrial:
    """A slot's trial: ``trial`` (an ``optuna.Trial`` to train, or the ``FrozenTrial`` of a finished one) and the
    config it trains."""

    sweep: Sweep
    study: Any
    slot: int
    trial: Any
    cfg: PipelineConfig

    @property
    def finished(self) -> dict[str, Any] | None:
        """What a finished trial recorded (a cleared sweep reuses it), else None."""
        from optuna.trial import FrozenTrial

        return self.trial.user_attrs.get(OUTCOME) if isinstance(self.trial, FrozenTrial) else None

    @property
    def key(self) -> str:
        return f"{self.study.study_name}/trial-{self.slot}"


def plan_sweep(cfg: PipelineConfig, run: RunInfo, sweep: Sweep) -> list[int]:
    """The sweep's study (created once per DAG run, with the points to try first) and its MLflow parent run; the
    slots the train task is mapped over. It runs first, so a bad sweep fails before any data is prepared."""
    from pipeline.registry import tracking

    study = sweep.create_study(run.key)
    with tracking.reachable("create the sweep's MLflow run"):
        tags = run.tags() | {"config.digest": cfg.digest(), "code.version": tracking.code_version(),
                             "pipeline.recipe": cfg.RECIPE, "sweep": "parent", "sweep.study": run.key}
        parent = tracking.ensure_run(cfg.registry.experiment, run.key, tags)
        searched = {d.field for d in sweep.space.dimensions}  # each trial's own, on its child run
        tracking.log_params_once(parent, {k: v for k, v in cfg.as_params().items() if k not in searched}
                                 | sweep_params(sweep))
    study.set_user_attr(PARENT_RUN, parent)
    log.info("sweep %s: %d trials of %s %s, pruner %s; MLflow parent run %s", run.key, sweep.config.n_trials,
             sweep.direction, sweep.config.objective, sweep.config.pruner, parent)
    return list(range(sweep.config.n_trials))


def start_trial(base: PipelineConfig, run: RunInfo, sweep: Sweep, slot: int) -> SlotTrial:
    """Slot ``slot``'s trial (found again on a retry or a cleared sweep) and the config it trains: ``base``
    with the trial's params."""
    study = sweep.load_study(run.key)
    trial = sweep.trial_for(study, slot)
    try:
        cfg = base.with_overrides(sweep.space.overrides(trial.params))
    except ConfigError as exc:  # params each field accepts, together a config it does not
        _record_error(trial, exc)
        raise
    log.info("trial %d (slot %d) %s: %s", trial.number, slot,
             getattr(getattr(trial, "state", None), "name", "RUNNING").lower(), json.dumps(trial.params))
    return SlotTrial(sweep, study, slot, trial, cfg)


def trial_job(slot: SlotTrial, run: RunInfo, dataset: PreparedData, map_index: int):
    """The trial's training job: a child run of the sweep's MLflow run, its own job folder (the mapped task's)."""
    tags = {"mlflow.parentRunId": slot.study.user_attrs[PARENT_RUN], "sweep.trial": str(slot.trial.number),
            "sweep.slot": str(slot.slot), "sweep.params": json.dumps(slot.trial.params), STATE_TAG: "running"}
    return train_job(slot.cfg, run, dataset, map_index=map_index, key=slot.key, tags=tags)


def trial_completed(slot: SlotTrial, trained: TrainedModel) -> dict[str, Any]:
    """Tell the study the trial's objective (its last epoch's), record its outcome; the task's XCom."""
    objective = slot.sweep.config.objective
    if objective not in trained.metrics:
        raise ConfigError(f"objective={objective!r}: trial {slot.trial.number}'s last validation has "
                          f"{sorted(trained.metrics)}; expected one of them")
    value = float(trained.metrics[objective])
    outcome = trained.to_xcom() | {"trial": _trial_facts(slot, "complete", value)}
    slot.trial.set_user_attr(OUTCOME, outcome)
    slot.study.tell(slot.trial, value, skip_if_finished=True)
    _end_child(trained.mlflow_run_id, "complete")
    log.info("trial %d complete: %s %.6g", slot.trial.number, objective, value)
    return outcome


def trial_pruned(slot: SlotTrial, spec, reason: str) -> dict[str, Any]:
    """Tell the study the trial was pruned (at its last reported epoch); the task's XCom."""
    from optuna.trial import TrialState

    outcome = {"trial": _trial_facts(slot, "pruned", None) | {"reason": reason}, "job_dir": str(spec.job_dir)}
    slot.trial.set_user_attr(OUTCOME, outcome)
    slot.study.tell(slot.trial, state=TrialState.PRUNED, skip_if_finished=True)
    _end_child(spec.env["MLFLOW_RUN_ID"], "pruned")
    log.info("%s", reason)
    return outcome


def trial_failed(slot: SlotTrial, error: BaseException) -> None:
    """Note what the trial failed on (``best_trial`` lists it; the study marks it failed once its task is done)."""
    _record_error(slot.trial, error.__cause__ or error)  # the user error under the task's AirflowFailException


def _record_error(trial, error: BaseException) -> None:
    trial.set_user_attr(ERROR, f"{type(error).__name__}: {error}"[:2000])


def best_trial(cfg: PipelineConfig, run: RunInfo, sweep: Sweep) -> dict[str, Any]:
    """The best complete trial's ``TrainedModel`` (with the config overrides it trained with in
    ``details.sweep.overrides``), after every slot's task ended. A trial still running belongs to a task that
    failed: it is marked failed. The sweep fails when no trial completed."""
    from optuna.trial import TrialState

    from pipeline.job.supervisor import run_tags
    from pipeline.registry import tracking

    study = sweep.load_study(run.key)
    trials = [t for t in study.get_trials(deepcopy=False) if SLOT in t.user_attrs]
    for t in trials:
        if t.state == TrialState.RUNNING:
            study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
    trials = [t for t in study.get_trials(deepcopy=False) if SLOT in t.user_attrs]
    by_state = {state: [t for t in trials if t.state == state]
                for state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)}
    failed = "; ".join(f"trial {t.number} (slot {t.user_attrs[SLOT]}): {t.user_attrs.get(ERROR, 'its task failed')}"
                       for t in by_state[TrialState.FAIL])
    counts = {"complete": len(by_state[TrialState.COMPLETE]), "pruned": len(by_state[TrialState.PRUNED]),
              "failed": len(by_state[TrialState.FAIL])}
    parent = study.user_attrs[PARENT_RUN]
    if not by_state[TrialState.COMPLETE]:
        with tracking.reachable("record the sweep's end"):
            tracking.set_tags(parent, {"sweep.summary": f"no trial completed: {json.dumps(counts)}"})
            tracking.end_run(parent, "FAILED")
        raise ConfigError(f"sweep {run.key}: no trial completed ({counts['pruned']} pruned, {counts['failed']} "
                          f"failed): {failed or 'every trial was pruned'}")
    best = study.best_trial
    outcome = best.user_attrs[OUTCOME]
    trained = TrainedModel.from_xcom({k: v for k, v in outcome.items() if k != "trial"})
    summary = (f"best trial {best.number} (slot {best.user_attrs[SLOT]}) {sweep.config.objective} {best.value:.6g} "
               f"with {json.dumps(best.params)}; {counts['complete']} complete, {counts['pruned']} pruned, "
               f"{counts['failed']} failed")
    spent = sweep_cost(run, trials)
    with tracking.reachable("record the sweep's best trial"):
        tracking.log_metrics_now(parent, {f"best_{sweep.config.objective}": best.value}
                                 | {f"trials_{state}": n for state, n in counts.items()}
                                 | {f"sweep_{key}": spent[key] for key in ("gpu_hours", "node_hours", "cost")})
        tracking.set_tags(parent, run_tags({"cost": spent}))
        tracking.set_tags(parent, {"sweep.best_trial": str(best.number), "sweep.best_run_id": trained.mlflow_run_id,
                                   "sweep.summary": summary, "dataset.version": trained.dataset_version})
        tracking.set_tags(trained.mlflow_run_id, {"sweep.best": "true"})
        tracking.end_run(parent, "FINISHED")
    log.info("%s%s", summary, f"; failed: {failed}" if failed else "")
    facts = {"best_trial": best.number, "value": best.value, "params": best.params, "trials": counts,
             "overrides": sweep.space.overrides(best.params), "parent_run_id": parent}
    # What the model cost is what finding it cost: every trial's attempts (the registered version's cost.* tags).
    return trained.to_xcom() | {"details": {**trained.details, "sweep": facts, "cost": spent}}


def sweep_cost(run: RunInfo, trials: list) -> dict[str, Any]:
    """Every trial's attempts summed (``pipeline.job.cost``), read from each slot's job folder (the train task's,
    by its map index)."""
    from pipeline.job.supervisor import run_figures
    from pipeline.job_files import JobFiles

    slots = sorted({t.user_attrs[SLOT] for t in trials})  # a slot's folder holds all its trials' attempts
    spent = [run_figures(JobFiles(run.job_dir("train", slot))).get("cost") for slot in slots]
    return {key: round(sum(c[key] for c in spent if c), 6) for key in ("attempts", "wall_s", "node_hours", "gpu_hours",
                                                                       "cost")}


def sweep_params(sweep: Sweep) -> dict[str, str]:
    """The sweep's settings as the parent run's MLflow params."""
    from dataclasses import asdict

    return ({f"sweep.{k}": str(v) for k, v in asdict(sweep.config).items()}
            | {"sweep.search_space": json.dumps({d.field: _dimension_text(d) for d in sweep.space.dimensions})[:6000],
               "sweep.direction": sweep.direction})


def _dimension_text(d) -> Any:
    return {"choices": list(d.choices)} if d.choices else {"low": d.low, "high": d.high, "log": d.log, "step": d.step}


def _trial_facts(slot: SlotTrial, state: str, value: float | None) -> dict[str, Any]:
    return {"number": slot.trial.number, "slot": slot.slot, "state": state, "value": value,
            "params": slot.trial.params, "objective": slot.sweep.config.objective}


def _end_child(mlflow_run_id: str, state: str) -> None:
    from pipeline.registry import tracking

    with tracking.reachable("record the trial's end"):
        tracking.set_tags(mlflow_run_id, {STATE_TAG: state})
        tracking.end_run(mlflow_run_id, "FINISHED" if state == "complete" else "KILLED")
