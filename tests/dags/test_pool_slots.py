"""Admission by the run's own size: a recipe DAG's `train` task instance takes as many training-pool slots as
THAT run's ranks, through the cluster policy Airflow itself calls (pipeline.airflow.admission, installed by
plugins/airflow_local_settings.py).

One fresh Airflow process with this project's settings (``deployment.airflow_env``: its plugins folder) on a
SQLite metadata DB of its own: Airflow's ``trigger_dag`` (what ``airflow dags trigger -c`` and the REST
trigger call: ``create_dagrun`` -> ``DagRun.verify_integrity``) creates the runs and their task instances,
then a clear re-creates one (``TaskInstance.refresh_from_task``); the rows the scheduler admits by are read back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pipeline import deployment

RUNS = {
    "default": {},
    "four_ranks": {"nproc_per_node": 4},
    "two_nodes": {"nproc_per_node": 3, "overrides": {"launch.nnodes": 2, "launch.rdzv_endpoint": "node-0:29400"}},
    "tiny_variant": {"variant": "tiny", "nproc_per_node": 4},
    "bad_conf": {"overrides": {"launch.nproc_per_node": 0}},  # a ConfigError: the task reports it, not the scheduler
}

# A recipe's train task in a DAG that is not named after the recipe, under another task id: admission knows it by
# what it is (a TrainOperator of a registered recipe), not by the DAG's id.
RENAMED_DAG = textwrap.dedent("""
    from airflow.sdk import Param, dag

    from pipeline.airflow.tasks import TrainOperator
    from pipeline.recipes import get_recipe

    recipe = get_recipe("tabular_mlp")


    @dag(dag_id="nightly_tables", schedule=None,
         params={name: Param(**schema) for name, schema in recipe.airflow_params().items()})
    def nightly_tables():
        TrainOperator(task_id="fit", recipe=recipe.name, prepared={}, pool_slots=2)


    nightly_tables()
""")

SCRIPT = textwrap.dedent("""
    import json, sys
    import airflow.settings
    from airflow.api.common.trigger_dag import trigger_dag
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db
    from airflow.models.dagbag import DBDagBag
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.db import upgradedb
    from airflow.utils.session import create_session
    from airflow.utils.types import DagRunTriggeredByType
    from sqlalchemy import select

    runs, folder = json.loads(sys.argv[1]), sys.argv[2]
    upgradedb()
    DagBundlesManager().sync_bundles_to_db()
    bag = DagBag(dag_folder=folder)
    assert not bag.import_errors, bag.import_errors
    sync_bag_to_db(bag, "dags-folder", None)
    for dag_id, confs in runs.items():
        for run_id, conf in confs.items():
            trigger_dag(dag_id, run_id=run_id, conf=conf, triggered_by=DagRunTriggeredByType.CLI)

    def slots():
        with create_session() as session:
            rows = session.execute(select(TaskInstance.dag_id, TaskInstance.run_id, TaskInstance.pool_slots)
                                   .where(TaskInstance.task_id.in_(["train", "fit"]))).all()
        return {f"{d}/{r}": s for d, r, s in rows}

    created = slots()
    # A clear (the UI's, a user's retry) re-reads the task: Airflow re-applies the policy with the run.
    with create_session() as session:
        dag = DBDagBag().get_latest_version_of_dag("tabular_mlp", session=session)
    dag.clear(task_ids=["train"], run_id="four_ranks")
    print("RESULT=" + json.dumps({
        "policy_installed": not airflow.settings.task_instance_mutation_hook.is_noop,
        "created": created, "after_clear": slots(),
        "heavy": sorted(m for m in ("torch", "mlflow", "pyarrow", "pandas", "streaming") if m in sys.modules),
    }))
""")


@pytest.fixture(scope="module")
def pool_slots(tmp_path_factory):
    """What Airflow wrote for the runs of RUNS: train pool_slots per dag_id/run_id, created and after a clear."""
    tmp = tmp_path_factory.mktemp("admission")
    dags = tmp / "dags"
    dags.mkdir()
    for name in ("tabular_mlp.py", "trl_sft_example.py", "sweeps.py"):  # a recipe DAG, a script DAG, the sweeps
        (dags / name).symlink_to(deployment.PROJECT_ROOT / "dags" / name)
    (dags / "nightly_tables.py").write_text(RENAMED_DAG)
    home = tmp / "airflow"
    env = {**os.environ, **deployment.airflow_env(home), "AIRFLOW_HOME": str(home),
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
           "AIRFLOW__CORE__DAGS_FOLDER": str(dags)}
    env.pop("PIPELINE_TRAIN_POOL_SLOTS", None)
    runs = {"tabular_mlp": RUNS, "trl_sft_example": {"script_four_ranks": {"nproc_per_node": 4}},
            "nightly_tables": {"four_ranks": {"nproc_per_node": 4}},
            "tabular_mlp_sweep": {"sweep_four_ranks": {"nproc_per_node": 4}}}
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(runs), str(dags)], env=env, cwd=tmp,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    line = next(l for l in done.stdout.splitlines() if l.startswith("RESULT="))
    return json.loads(line.removeprefix("RESULT=")), done.stdout + done.stderr


def test_airflow_loads_the_policy_from_the_deployment_settings_without_heavy_imports(pool_slots):
    result, _ = pool_slots
    assert result["policy_installed"]
    assert result["heavy"] == []


def test_a_run_takes_as_many_slots_as_its_own_ranks(pool_slots):
    result, _ = pool_slots
    created = result["created"]
    assert created["tabular_mlp/default"] == 2  # the default config's 2 ranks
    assert created["tabular_mlp/four_ranks"] == 4  # nproc_per_node=4 from the trigger form / -c conf
    assert created["tabular_mlp/two_nodes"] == 6  # 3 ranks x 2 nodes (an override)
    assert created["tabular_mlp/tiny_variant"] == 4
    # A clear re-reads the task's parse-time slots (2): the policy puts the run's back.
    assert result["after_clear"]["tabular_mlp/four_ranks"] == 4


def test_a_bad_conf_leaves_the_default_and_does_not_fail_the_run_creation(pool_slots):
    result, log = pool_slots
    assert result["created"]["tabular_mlp/bad_conf"] == 2
    assert "pool slots of tabular_mlp.train for run bad_conf left at 2: ConfigError" in log


def test_a_script_dag_keeps_the_slots_of_its_fixed_ranks(pool_slots):
    # TorchrunOperator's ranks are its arguments, not the run's Params: its 2 slots are every run's.
    result, _ = pool_slots
    assert result["created"]["trl_sft_example/script_four_ranks"] == 2


def test_a_recipes_train_task_is_known_by_its_operator_not_by_its_dag_id(pool_slots):
    # nightly_tables is no recipe's name and its task is "fit": the run's 4 ranks still size it.
    result, _ = pool_slots
    assert result["created"]["nightly_tables/four_ranks"] == 4


def test_a_sweeps_mapped_trials_take_their_runs_ranks(pool_slots):
    # The mapped train task keeps its recipe in partial_kwargs; its instance (expanded alike later) is sized by the run.
    result, _ = pool_slots
    assert result["created"]["tabular_mlp_sweep/sweep_four_ranks"] == 4
