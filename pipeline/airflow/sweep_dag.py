"""A recipe's sweep DAG, ``<recipe>_sweep``, from the same parts as its pipeline DAG:
plan_sweep -> prepare_data -> train (mapped: one distributed trial per slot) -> best_trial -> register_model ->
evaluate -> approve -> promote.

Each trial is a mapped instance of ``TrialOperator``, a ``TrainOperator`` that takes its own slots of the training
pool (the admission policy sizes it by the run's ranks), so the ``gpu`` pool bounds how many train at once, and
``trials_at_once`` (the mapped task's ``max_active_tis_per_dagrun``, fixed when the DAG file is parsed) bounds it
further. The study, the pruner and MLflow's parent and child runs are ``pipeline.sweep`` and
``pipeline.stages.sweep``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Sequence

from airflow.sdk import Param, dag, task

from pipeline import deployment
from pipeline.airflow.dag_factory import admission, prepare_data, release
from pipeline.airflow.links import with_mlflow_link
from pipeline.airflow.tasks import TrainOperator, task_run
from pipeline.recipes import get_recipe

TRIALS_AT_ONCE = 2


def sweep_dag(recipe_name: str, *, trials_at_once: int = TRIALS_AT_ONCE, doc_md: str | None = None, **dag_kwargs: Any):
    """The sweep DAG of a registered recipe; triggered by hand (the Params form: the recipe's Params, the search
    space and the study's settings) or by ``airflow dags trigger -c``."""
    from pipeline.sweep.study import airflow_params

    recipe = get_recipe(recipe_name)
    params = recipe.airflow_params() | airflow_params(recipe.config())

    @dag(
        dag_id=f"{recipe.name}_sweep",
        schedule=None,
        catchup=False,
        max_active_runs=1,
        default_args={"retries": 2, "retry_delay": timedelta(seconds=deployment.retry_delay_s())},
        tags=[*recipe.tags, "sweep"],
        params={name: Param(**schema) for name, schema in params.items()},
        doc_md=doc_md or f"Hyperparameter sweep of {recipe.name}: {recipe.description}",
        **dag_kwargs,
    )
    def sweep_pipeline():
        @task(retries=0)
        def plan_sweep() -> list[int]:
            from pipeline.stages.sweep import plan_sweep

            return sweep_stage(plan_sweep, recipe)

        @task(trigger_rule="all_done", retries=0)
        def best_trial() -> dict:
            from pipeline.stages.sweep import best_trial

            return sweep_stage(best_trial, recipe)

        slots = plan_sweep()
        prepared = prepare_data(recipe)()
        slots >> prepared
        trials = TrialOperator.partial(task_id="train", recipe=recipe.name, prepared=prepared,
                                       max_active_tis_per_dagrun=trials_at_once, **admission(recipe)).expand(slot=slots)
        best = best_trial()
        trials >> best
        release(best_config(recipe), prepared, with_mlflow_link(best))

    return sweep_pipeline()


def sweep_stage(stage: Callable[..., Any], recipe) -> Any:
    """``stage(cfg, run, sweep)`` for the current task instance, a bad sweep or config failing it without retries."""
    from airflow.sdk import get_current_context

    from pipeline.airflow.operator import user_errors_fail
    from pipeline.sweep.study import Sweep

    context = get_current_context()
    run = task_run(context)
    with user_errors_fail():
        params = dict(context["params"])
        cfg = recipe.config_from_params(params)
        return stage(cfg, run, Sweep.from_params(params, cfg))


def best_config(recipe) -> Callable[[dict[str, Any]], Any]:
    """The release tasks' config: the run's, with the best trial's params (``best_trial``'s XCom) applied."""

    def config_from_params(params: dict[str, Any]):
        from airflow.sdk import get_current_context

        best = get_current_context()["ti"].xcom_pull(task_ids="best_trial")
        return recipe.config_from_params(params).with_overrides(best["details"]["sweep"]["overrides"])

    return config_from_params


class TrialOperator(TrainOperator):
    """A sweep's train task, mapped over its slots: the slot's trial (asked from the study, or found again on a
    retry) trains as the run's ``train`` would, with the trial's params, its own job folder and a child MLflow run,
    while the study's pruner watches its epochs (``pipeline.sweep.pruning``). A pruned trial ends the task
    successfully with the ``pruned`` outcome, never retried; a trial finished in an earlier run of the same
    sweep (a clear) returns what it recorded without training again."""

    template_fields: Sequence[str] = ("prepared", "slot")

    def __init__(self, *, slot: Any, **kwargs: Any):
        super().__init__(**kwargs)
        self.slot = slot
        self._trial = None
        self._trial_spec = None

    def execute(self, context) -> Any:
        from pipeline.airflow.operator import user_errors_fail
        from pipeline.errors import TrainingPruned
        from pipeline.stages.sweep import start_trial, trial_failed, trial_pruned
        from pipeline.sweep.study import Sweep

        params = dict(context["params"])
        with user_errors_fail():
            base = get_recipe(self.recipe).config_from_params(params)
            self._trial = start_trial(base, task_run(context), Sweep.from_params(params, base), int(self.slot))
        if self._trial.finished is not None:
            self.log.info("trial %d finished in an earlier run of this sweep: its outcome is reused",
                          self._trial.trial.number)
            return self._trial.finished
        try:
            return super().execute(context)
        except TrainingPruned as pruned:
            return trial_pruned(self._trial, self._trial_spec, str(pruned))
        except BaseException as exc:
            trial_failed(self._trial, exc)
            raise

    def _spec(self, context):
        from pipeline.errors import ConfigError
        from pipeline.results import PreparedData, from_xcom_as
        from pipeline.stages.sweep import trial_job

        cfg = self._trial.cfg
        if cfg.launch.deferrable:
            raise ConfigError(f"launch.{cfg.launch.kind}.deferrable=true: a sweep's pruner stops a trial from the "
                              f"worker that supervises it; expected deferrable=false for sweep trials")
        dataset = from_xcom_as(PreparedData, self.prepared, "train's argument 'prepared'")
        self.metrics_flush_timeout_s = cfg.train.metrics_flush_timeout_s
        self._trial_spec = trial_job(self._trial, task_run(context), dataset, context["ti"].map_index)
        return self._trial_spec

    def _pruner(self, spec):
        from pipeline.sweep.pruning import EpochPruner

        return EpochPruner(self._trial.trial, spec.files.metrics, self._trial.sweep.config.objective)

    def _result(self, context, spec, result, wall_s):
        from pipeline import stages
        from pipeline.stages.sweep import trial_completed

        return trial_completed(self._trial, stages.trained_model(spec, result, wall_s))
