"""@task.torchrun and TorchrunOperator run by Airflow (dag.test) on real torchrun ranks."""

from __future__ import annotations

import os
import textwrap

import pytest

from pipeline.dev.demo import run_dag
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
    import threading
    import time

    from pipeline import deployment
    from tests.processes import pids_with

    marker = str(deployment.runs_dir() / "torchrun_timeout") + "/"  # the job folder, on every command line
    dag_file = tmp_path / "timeout_dag.py"
    dag_file.write_text(textwrap.dedent('''
        from datetime import timedelta
        from airflow.sdk import dag, task

        @dag(dag_id="torchrun_timeout", schedule=None, catchup=False)
        def torchrun_timeout():
            @task.torchrun(nproc_per_node=2, retries=0, execution_timeout=timedelta(seconds=20), grace_period_s=3)
            def sleep_forever():
                import time
                time.sleep(600)

            sleep_forever()

        torchrun_timeout()
    '''))
    seen: set[int] = set()
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen.update(pids_with(marker))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        dag_run = run_dag("torchrun_timeout", {}, dag_file=dag_file)
    finally:
        done.set()
        watcher.join()
    assert _state(dag_run) == "failed"
    assert len(seen) >= 4, f"the guard, the torchrun agent and two ranks never ran: {seen}"
    assert wait_until_gone(marker) == [], "ranks outlived the timed-out task"
