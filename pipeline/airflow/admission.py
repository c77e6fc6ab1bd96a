"""Admission by the run's own size: a recipe DAG's ``train`` task instance takes as many slots of the
training pool as THAT run's ranks, ``launch.nproc_per_node x launch.nnodes`` of the config its Params and
conf make (``PIPELINE_TRAIN_POOL_SLOTS`` still overrides, as for the decorator's default).

An Airflow cluster policy, ``task_instance_mutation_hook(task_instance, dag_run)`` (``airflow.policies``).
Airflow 3.3 calls it where it creates a run's task instances (``DagRun.verify_integrity`` from
``create_dagrun``: the api-server or CLI for a triggered run, the scheduler for a scheduled or
asset-triggered one) and again where it re-reads them (a new DAG version, a clear:
``TaskInstance.refresh_from_task``), all before the scheduler admits an instance by its row's
``pool_slots``. ``plugins/airflow_local_settings.py`` installs it: Airflow puts the plugins folder on
``sys.path`` before importing that module, in every component.

It runs inside the scheduler's transaction, so it is cheap and never raises: no torch, no MLflow, no
database access (Airflow forbids a commit there). A conf that does not make a valid config leaves the
DAG's default slots; the task itself then fails with the config error. Only a recipe's train task is
touched, known by what it is, not by its DAG's or its own id: a ``TrainOperator`` (``pipeline.airflow.tasks``)
of a registered recipe, in whatever DAG it was put. A script DAG's ranks are fixed when its file is parsed
(``TorchrunOperator``'s launch arguments), so its parse-time slots already are each run's.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from typing import Any

# The task_types (class names) of ``TrainOperator`` and a sweep's ``TrialOperator``, which Airflow serializes with
# every task: the scheduler holds the serialized task, not the class, and importing the operators here would load
# the task SDK.
TRAIN_OPERATORS = ("TrainOperator", "TrialOperator")

log = logging.getLogger(__name__)


def task_instance_mutation_hook(task_instance: Any, dag_run: Any = None) -> None:
    """Set a recipe train task's instance's ``pool_slots`` to its run's ranks; leave anything else."""
    if dag_run is None:
        return  # no run yet (a TaskInstance being constructed): Airflow calls again with it
    try:
        recipe = recipe_of(getattr(task_instance, "task", None))
        if recipe is None:
            return
        params = run_params(_dag_of(task_instance, dag_run), dag_run.conf, recipe)
        slots = train_pool_slots(recipe, params)
    except Exception as exc:  # a bad conf must not fail the scheduler: the task reports it
        log.warning("pool slots of %s.%s for run %s left at %s: %s: %s", task_instance.dag_id,
                    task_instance.task_id, getattr(dag_run, "run_id", "?"), task_instance.pool_slots,
                    type(exc).__name__, exc)
        return
    if task_instance.pool_slots != slots:
        task_instance.pool_slots = slots


def recipe_of(task: Any) -> str | None:
    """The recipe ``task`` trains when it is a recipe's train task, else None: a ``TrainOperator`` or a sweep's
    ``TrialOperator`` (by its serialized ``task_type``) whose ``recipe``, which it adds to its serialized fields, is a registered one."""
    if getattr(task, "task_type", None) not in TRAIN_OPERATORS:
        return None
    from pipeline.recipes import registry

    # A sweep's mapped train task keeps its arguments in ``partial_kwargs`` (each mapped instance is sized alike).
    recipe = getattr(task, "recipe", None) or (getattr(task, "partial_kwargs", None) or {}).get("recipe")
    return recipe if recipe in registry() else None


def train_pool_slots(recipe: str, params: dict[str, Any]) -> int:
    """Pool slots of a ``recipe`` run's training with the Params ``params`` (the form's values and conf)."""
    from pipeline import deployment

    return deployment.train_pool_slots(run_ranks(recipe, json.dumps(params, sort_keys=True, default=str)))


@lru_cache(maxsize=256)
def run_ranks(recipe: str, params_json: str) -> int:
    """``launch.nproc_per_node x launch.nnodes`` of the run's config (raises ``ConfigError`` on a bad one)."""
    from pipeline.recipes import get_recipe

    launch = get_recipe(recipe).config_from_params(json.loads(params_json)).launch
    return launch.nproc_per_node * launch.nnodes


def run_params(dag: Any, conf: dict[str, Any] | None, recipe: str) -> dict[str, Any]:
    """The Params a run's tasks see: the DAG's defaults (the recipe's when the DAG is not at hand), then
    the run's conf, as Airflow merges them (``[core] dag_run_conf_overrides_params``, on by default)."""
    params = getattr(dag, "params", None)
    if params is not None and hasattr(params, "dump"):
        merged = dict(params.dump())
    else:
        from pipeline.recipes import get_recipe

        merged = {name: schema.get("default") for name, schema in get_recipe(recipe).airflow_params().items()}
    if conf and _conf_overrides_params():
        merged.update(conf)
    return merged


def _dag_of(task_instance: Any, dag_run: Any) -> Any:
    try:  # an operator not yet bound to a DAG raises rather than answering None
        dag = task_instance.task.dag
    except Exception:
        dag = None
    return dag or getattr(dag_run, "dag", None)


def _conf_overrides_params() -> bool:
    try:
        from airflow.configuration import conf
    except ImportError:
        return True
    return conf.getboolean("core", "dag_run_conf_overrides_params", fallback=True)
