"""@task.torchrun and TorchrunOperator run by Airflow (dag.test) on real torchrun ranks."""

from __future__ import annotations

import os
import textwrap

import pytest

from pipeline.demo import run_dag
from tests.processes import wait_until_gone

pytestmark = pytest.mark.e2e


def _xcoms(dag_id: str, run_id: str) -> dict:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = session.scalars(XComModel.get_many(run_id=run_id, key="return_value", dag_ids=dag_id)).all()
        return {row.task_id: XComModel.deserialize_value(row) for row in rows}


def _state(dag_run) -> str:
    return str(getattr(dag_run.state, "value", dag_run.state))


def test_the_example_dag_runs_a_function_and_a_plain_script_on_two_ranks(airflow_db):
    dag_run = run_dag("torchrun_example", {})
    assert _state(dag_run) == "success"
    xcoms = _xcoms("torchrun_example", dag_run.run_id)
    # Ranks 0 and 1 contributed 10 and 20: the all_reduce really spanned two processes.
    assert xcoms["all_reduce"] == {"world_size": 2, "sum": 30.0}
    script = xcoms["ddp_script"]
    assert script["world_size"] == 2 and script["start_step"] == 0
    assert script["final_loss"] < 0.05  # the regression converged
    assert os.path.isdir(os.path.join(script["job_dir"], "checkpoints"))


def test_execution_timeout_stops_every_rank(airflow_db, tmp_path):
    marker = f"torchrun-timeout-{os.getpid()}"
    dag_file = tmp_path / "timeout_dag.py"
    dag_file.write_text(textwrap.dedent(f'''
        from datetime import timedelta
        from airflow.sdk import dag, task

        @dag(dag_id="torchrun_timeout", schedule=None, catchup=False)
        def torchrun_timeout():
            @task.torchrun(nproc_per_node=2, retries=0, execution_timeout=timedelta(seconds=15), grace_period_s=3)
            def sleep_forever(marker: str):
                import time
                time.sleep(600)

            sleep_forever({marker!r})

        torchrun_timeout()
    '''))
    dag_run = run_dag("torchrun_timeout", {}, dag_file=dag_file)
    assert _state(dag_run) == "failed"
    assert wait_until_gone(marker) == [], "ranks outlived the timed-out task"
