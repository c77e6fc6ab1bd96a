"""The sweep's failure rule, run by Airflow (dag.test) on real torchrun ranks: a trial whose params are a user error
in its ranks fails at once (no retry) and fails only itself; the sweep fails only when no trial completed, saying
why each failed."""

from __future__ import annotations

import pytest

from pipeline.dev.demo import run_dag
from pipeline.stages.run import RunInfo

pytestmark = pytest.mark.e2e

DAG_ID = "tabular_mlp_sweep"
# CPU offload of FSDP's shards needs a GPU: on these ranks it is a ConfigError raised in every rank.
SPACE = {"train.cpu_offload": {"choices": [False, True]}}


def _conf(demo_parquet, model: str, **sweep) -> dict:
    return {"variant": "tiny", "input_path": str(demo_parquet), "epochs": 2, "model_name": model,
            "overrides": {"registry.experiment": model, "train.parallelism": "fsdp"}, "search_space": SPACE, **sweep}


def _instances(run_id: str) -> dict[tuple[str, int], tuple[str, int]]:
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = session.query(TaskInstance).filter(TaskInstance.dag_id == DAG_ID, TaskInstance.run_id == run_id).all()
        return {(ti.task_id, ti.map_index): (str(getattr(ti.state, "value", ti.state)), ti.try_number) for ti in rows}


def _run(conf: dict):
    from pipeline import deployment

    return run_dag(DAG_ID, conf, deployment.PROJECT_ROOT / "dags" / "sweeps.py")


def test_a_trial_failing_on_its_params_fails_alone_and_the_sweep_releases_the_best_of_the_rest(airflow_db, demo_parquet):
    import optuna
    from optuna.trial import TrialState

    from pipeline.registry.tracking import client
    from pipeline.sweep.study import storage

    model = "tabular_mlp_sweep_one_fails"
    dag_run = _run(_conf(demo_parquet, model, n_trials=2, enqueue=[{"train.cpu_offload": True},
                                                                    {"train.cpu_offload": False}]))
    states = _instances(dag_run.run_id)
    assert str(getattr(dag_run.state, "value", dag_run.state)) == "success", states

    # The slot that starts first takes the first enqueued point; the mapped tasks may start in either order.
    study = optuna.load_study(study_name=RunInfo(DAG_ID, dag_run.run_id).key, storage=storage())
    failed, complete = sorted(study.trials, key=lambda t: t.params["train.cpu_offload"], reverse=True)
    assert failed.state == TrialState.FAIL and "cpu_offload" in failed.user_attrs["error"]
    assert complete.state == TrialState.COMPLETE and complete.params == {"train.cpu_offload": False}
    assert states[("train", failed.user_attrs["slot"])] == ("failed", 1)  # a user error: no retry
    assert states[("train", complete.user_attrs["slot"])][0] == "success" and states[("promote", -1)][0] == "success"
    parent = next(r for r in client().search_runs([client().get_experiment_by_name(model).experiment_id])
                  if r.data.tags.get("sweep") == "parent")
    assert parent.data.tags["sweep.summary"].endswith("1 complete, 0 pruned, 1 failed")
    assert [v.run_id for v in client().search_model_versions(f"name = '{model}'")] == [parent.data.tags["sweep.best_run_id"]]


def test_the_sweep_fails_when_no_trial_completed_naming_what_each_failed_on(airflow_db, demo_parquet):
    import optuna

    from pipeline.errors import ConfigError
    from pipeline.recipes import get_recipe
    from pipeline.stages.sweep import best_trial
    from pipeline.sweep.study import Sweep, storage

    conf = _conf(demo_parquet, "tabular_mlp_sweep_all_fail", n_trials=1, enqueue=[{"train.cpu_offload": True}])
    dag_run = _run(conf)
    states = _instances(dag_run.run_id)
    assert str(getattr(dag_run.state, "value", dag_run.state)) == "failed"
    assert states[("train", 0)] == ("failed", 1) and states[("best_trial", -1)] == ("failed", 1)
    assert states[("register_model", -1)][0] == "upstream_failed"
    (trial,) = optuna.load_study(study_name=RunInfo(DAG_ID, dag_run.run_id).key, storage=storage()).trials
    assert "cpu_offload" in trial.user_attrs["error"]
    # What the best_trial task failed on: asked again, the stage says the same.
    cfg = get_recipe("tabular_mlp").config_from_params(conf)
    with pytest.raises(ConfigError, match=r"no trial completed \(0 pruned, 1 failed\): trial 0 \(slot 0\): "
                                          r"RankUserError: .*cpu_offload"):
        best_trial(cfg, RunInfo(DAG_ID, dag_run.run_id), Sweep.from_params(conf, cfg))


def test_an_impossible_range_fails_the_first_task_before_any_data_is_prepared(airflow_db, demo_parquet):
    conf = _conf(demo_parquet, "tabular_mlp_sweep_bad_range", n_trials=2)
    conf["search_space"] = {"train.learning_rate": {"low": 0.01, "high": 0.001}}
    dag_run = _run(conf)
    states = _instances(dag_run.run_id)
    assert str(getattr(dag_run.state, "value", dag_run.state)) == "failed"
    assert states[("plan_sweep", -1)] == ("failed", 1)  # a user error: no retry
    assert states[("prepare_data", -1)][0] == "upstream_failed"
