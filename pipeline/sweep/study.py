"""A sweep's settings and its Optuna study: one study per sweep run, named by its DAG run and kept in the
deployment's database (``deployment.sweep_database``), so a cleared or retried sweep finds every trial again.

Each trial belongs to a slot, the mapped train task's index: the slot asks the study for a trial when it starts
(TPE then learns from every trial already told), tags it with its slot, and finds it again on a retry (same
params, same job folder, so it resumes from its checkpoints). A slot whose trial finished returns what it recorded;
one whose trial failed asks for a new one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pipeline import deployment
from pipeline.config import PipelineConfig
from pipeline.config_fields import build, where_field
from pipeline.errors import ConfigError
from pipeline.sweep.space import SearchSpace, check_point

log = logging.getLogger(__name__)

SLOT = "slot"  # the user attribute that binds a trial to its slot
OUTCOME = "outcome"  # the user attribute of a finished trial: the train task's XCom (or the pruning's record)
DIRECTIONS = ("auto", "minimize", "maximize")


@dataclass(kw_only=True)
class SweepConfig:
    n_trials: int = where_field(8, "Trials of the sweep: the train task is mapped over this many slots.", min=1, max=1000)
    objective: str = where_field(
        "val_loss", "The per-epoch validation metric the study optimises and the pruner compares (val_loss or "
        "val_<metric>, as the epoch lines of the training log name them).")
    direction: str = where_field(
        "auto", "minimize or maximize the objective; auto: minimize val_loss, and a val_<metric> the way the "
        "recipe's metric improves.", choices=list(DIRECTIONS))
    pruner: str = where_field(
        "median", "What stops a trial early: median (its epoch's value worse than the median of the finished "
        "trials' at that epoch), successive_halving (asynchronous), or none.",
        choices=["median", "successive_halving", "none"])
    prune_after_trials: int = where_field(2, "Finished trials before the median pruner prunes any.", min=0, max=1000)
    prune_after_epochs: int = where_field(1, "Epochs a trial always trains before it can be pruned.", min=0, max=1000)
    sampler_seed: int = where_field(0, "Seed of the TPE sampler.", min=0)


@dataclass(frozen=True)
class Sweep:
    """A sweep run's settings: the checked search space, the points to try first and the study's options."""

    config: SweepConfig
    space: SearchSpace
    enqueue: tuple[dict[str, Any], ...] = field(default=())
    direction: str = "minimize"

    @classmethod
    def from_params(cls, params: dict[str, Any], base: PipelineConfig) -> "Sweep":
        """The sweep Params of a run (``search_space``, ``enqueue`` and ``SweepConfig``'s fields) checked against the
        run's config ``base``; a ``ConfigError`` names the Param, the value and what was expected."""
        config = build(SweepConfig, {k: params[k] for k in sweep_param_names() if k in params}, prefix="")
        space = SearchSpace.parse(params.get("search_space"), base)
        points = params.get("enqueue") or []
        if not isinstance(points, list):
            raise ConfigError(f"enqueue={points!r}: expected a list of points of the search space")
        enqueue = tuple(check_point(p, space, base, f"enqueue[{i}]") for i, p in enumerate(points))
        return cls(config, space, enqueue, direction(config.objective, config.direction, base))

    def create_study(self, name: str):
        """The study of sweep run ``name``, created on first use with its points to try first."""
        import optuna

        study = optuna.create_study(study_name=name, storage=storage(), direction=self.direction,
                                    sampler=self.sampler(), pruner=self.make_pruner(), load_if_exists=True)
        if not study.get_trials(deepcopy=False):  # once: a cleared sweep's plan finds them there
            for point in self.enqueue:
                study.enqueue_trial(self.space.encode(point))
        return study

    def load_study(self, name: str):
        import optuna

        try:
            return optuna.load_study(study_name=name, storage=storage(), sampler=self.sampler(),
                                     pruner=self.make_pruner())
        except KeyError:
            raise RuntimeError(f"no sweep study {name!r} in {_safe_url()}: the sweep's plan task creates it") from None

    def sampler(self):
        import optuna

        # Parallel trials ask before the running ones are told: the constant liar keeps them apart.
        startup = max(2, self.config.n_trials // 4)
        return optuna.samplers.TPESampler(seed=self.config.sampler_seed, n_startup_trials=startup, constant_liar=True)

    def make_pruner(self):
        import optuna

        c = self.config
        if c.pruner == "median":
            return optuna.pruners.MedianPruner(n_startup_trials=c.prune_after_trials, n_warmup_steps=c.prune_after_epochs)
        if c.pruner == "successive_halving":
            return optuna.pruners.SuccessiveHalvingPruner(min_resource=max(1, c.prune_after_epochs))
        return optuna.pruners.NopPruner()

    def trial_for(self, study, slot: int):
        """Slot ``slot``'s trial: the finished one (a ``FrozenTrial``), the running one of an earlier try, or a new
        one (an ``optuna.Trial``: a point to try first while any waits, else sampled). A slot whose trial failed
        asks for a new one."""
        import optuna
        from optuna.trial import TrialState

        mine = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get(SLOT) == slot]
        last = max(mine, key=lambda t: t.number) if mine else None
        if last is not None and last.state in (TrialState.COMPLETE, TrialState.PRUNED):
            return last
        if last is not None and last.state == TrialState.RUNNING:
            return optuna.trial.Trial(study, last._trial_id)
        trial = study.ask()
        for dimension in self.space.dimensions:
            dimension.suggest(trial)  # an enqueued point's values are read back, the others sampled
        trial.set_user_attr(SLOT, slot)
        return trial

    def overrides(self, trial) -> dict[str, Any]:
        """The config overrides of ``trial``'s params."""
        return self.space.overrides(trial.params)


DEFAULT_SPACE = {"train.learning_rate": {"low": 1e-4, "high": 1e-2, "log": True}}


def sweep_param_names() -> list[str]:
    from dataclasses import fields

    return [f.name for f in fields(SweepConfig)]


def airflow_params(base: PipelineConfig) -> dict[str, dict[str, Any]]:
    """The sweep's Params beside the recipe's (JSON-schema keyword sets): ``search_space``, ``enqueue`` and
    ``SweepConfig``'s fields."""
    import typing
    from dataclasses import fields

    from pipeline.config_fields import param_schema
    from pipeline.sweep.space import param_schema as space_schema

    hints = typing.get_type_hints(SweepConfig)
    params = {
        "search_space": {**space_schema(base), "default": DEFAULT_SPACE, "description": (
            'Config fields to search, each a range {"low": 0.0001, "high": 0.01, "log": true} (int and float '
            'fields; "step" for a grid) or {"choices": [...]}; model.* and train.* fields only.')},
        "enqueue": {"default": [], "type": "array", "items": {"type": "object"}, "description": (
            "Points of the search space to try first, in order (e.g. the current champion's settings), each "
            '{"train.learning_rate": 0.003, ...}; the rest are sampled.')},
    }
    return params | {f.name: param_schema(hints[f.name], f.metadata, f.default) for f in fields(SweepConfig)}


def direction(objective: str, chosen: str, base: PipelineConfig) -> str:
    """``chosen`` unless ``auto``: minimize a loss, and a recipe metric's validation value the way it improves."""
    if chosen != "auto":
        return chosen
    name = objective.removeprefix("val_")
    if name == "loss" or name.endswith("_loss"):
        return "minimize"
    if name in base.METRICS:
        return "maximize" if base.METRICS[name] else "minimize"
    raise ConfigError(f"direction=auto: objective={objective!r} is neither a loss nor val_<metric> of the recipe's "
                      f"metrics {sorted(base.METRICS)}; expected direction=minimize or maximize")


def storage():
    """The studies' storage on the deployment's database (SQLite waits for its lock rather than failing)."""
    import optuna

    optuna.logging.disable_default_handler()  # its lines go through Python logging, into the task log at their level
    optuna.logging.enable_propagation()
    url = deployment.sweep_database()
    engine_kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith("sqlite:///"):
        from pathlib import Path

        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        engine_kwargs = {"connect_args": {"timeout": 60}}
    return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)


def _safe_url() -> str:
    """The storage's URL without its password (for messages)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(deployment.sweep_database())
    host = parts.hostname or ""
    netloc = (f"{parts.username}@" if parts.username else "") + host + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
