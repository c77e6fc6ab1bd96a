"""`make ui` (the embedded default with its UIs, in the foreground) stopped with Ctrl-C while a torchrun
task runs: every process it started ends, no port stays bound, and no task is left marked running.
`airflow standalone` left the dag-processor alive, airflow.db open and the interrupted task running."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys

import psutil
import pytest

from pipeline.dev.stack.rest import RestClient
from pipeline.process_table import alive
from tests.e2e.test_airflow_kill import (
    DAG_ID,
    KILL_DAG_SOURCE,
    trigger_and_wait_for_ranks,
)
from tests.services import free_port, wait_for

pytestmark = pytest.mark.e2e


def test_ctrl_c_of_make_ui_ends_every_process_and_leaves_no_task_running(tmp_path):
    from datetime import date

    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "torchrun_kill.py").write_text(KILL_DAG_SOURCE)
    home = tmp_path / "home"
    airflow_port, mlflow_port = free_port(), free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("AIRFLOW")}
    env.update({"PIPELINE_HOME": str(home), "PIPELINE_STACK_AIRFLOW_PORT": str(airflow_port),
                "PIPELINE_STACK_MLFLOW_PORT": str(mlflow_port), "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
                "PIPELINE_DAILY_START_DATE": str(date.today())})
    out = tmp_path / "ui.out"
    ui = subprocess.Popen([sys.executable, "-m", "pipeline.dev.stack", "ui"], env=env, stdout=open(out, "w"),
                          stderr=subprocess.STDOUT, start_new_session=True)
    try:
        banner = wait_for(lambda: re.search(r"Airflow UI\s+(\S+)\s+user admin\s+password (\S+)", out.read_text()),
                          "the ready banner of make ui", timeout_s=240, poll_s=1)
        assert banner.group(1) == f"http://127.0.0.1:{airflow_port}"
        assert f"MLflow UI   http://127.0.0.1:{mlflow_port}" in out.read_text()
        assert (home / "data" / "raw" / "tabular_daily" / f"dt={date.today()}").is_dir()  # demo inputs written
        client = RestClient(banner.group(1), "admin", banner.group(2))
        wait_for(lambda: _has_dag(client), "the dag-processor to parse the DAG", timeout_s=120, poll_s=1)
        client.request("PATCH", f"/api/v2/dags/{DAG_ID}", {"is_paused": False})
        run_id, job = trigger_and_wait_for_ranks(client, str(home / "runs" / DAG_ID) + "/")
        everyone = {ui.pid, *(p.pid for p in psutil.Process(ui.pid).children(recursive=True))}
        assert job <= everyone  # the task's ranks descend from what make ui started
        listening = [(c.laddr.ip, c.laddr.port) for c in psutil.net_connections("inet")
                     if c.status == psutil.CONN_LISTEN and c.pid in everyone - job]  # torchrun's own store aside
        assert {airflow_port, mlflow_port} <= {port for _, port in listening}
        assert all(ip == "127.0.0.1" for ip, _ in listening), listening  # no log server on 0.0.0.0

        ui.send_signal(signal.SIGINT)  # Ctrl-C
        ui.wait(timeout=120)
    finally:
        if ui.poll() is None:  # the test failed before its Ctrl-C: stop it anyway, its services included
            started = psutil.Process(ui.pid).children(recursive=True)
            ui.send_signal(signal.SIGINT)
            try:
                ui.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(ui.pid, signal.SIGKILL)
            for process in started:
                try:
                    process.kill()
                except psutil.Error:
                    pass
    assert ui.returncode == 0, out.read_text()[-3000:]
    assert not [pid for pid in everyone if alive(pid)], out.read_text()[-3000:]
    bound = {c.laddr.port for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    assert not bound & {airflow_port, mlflow_port}
    with sqlite3.connect(home / "airflow" / "airflow.db") as db:
        states = db.execute("SELECT task_id, state FROM task_instance WHERE dag_id = ?", (DAG_ID,)).fetchall()
    assert states == [("sleep_long", "failed")], states


def _has_dag(client) -> bool:
    try:
        client.request("GET", f"/api/v2/dags/{DAG_ID}")
        return True
    except OSError:
        return False
