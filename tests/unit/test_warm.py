"""Warm task processes (pipeline.airflow.warm): the modules a Celery worker imports when it starts, through the
configuration Airflow resolves from ``[celery] celery_config_options``, and what PIPELINE_PRELOAD names."""

import os
import subprocess
import sys

import pytest

from pipeline.airflow import warm

WORKER = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
from airflow.providers.celery.executors.celery_executor_utils import get_celery_configuration
from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG

config = get_celery_configuration()  # what Airflow's Celery app and worker are built from
assert config is DEFAULT_CELERY_CONFIG, "not Airflow's own configuration"
assert "wave" not in sys.modules, "imported before the worker started"
from celery.signals import worker_init

worker_init.send(sender=None)  # what a Celery worker sends before its pool forks
print("imported" if "wave" in sys.modules and "colorsys" in sys.modules else "missing")
"""


def test_a_celery_worker_preloads_the_modules_when_it_starts_not_before():
    env = {**os.environ, "AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS": "pipeline.airflow.warm.CELERY_CONFIG",
           "PIPELINE_PRELOAD": "wave, pipeline_no_such_module,colorsys"}
    done = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "imported"
    # The module that does not exist is reported and skipped; the others are still imported.
    assert any("preloading pipeline_no_such_module failed: ModuleNotFoundError" in line for line in lines), lines
    assert any("preloaded wave, colorsys in " in line for line in lines), lines


@pytest.mark.parametrize(("value", "expected"), [
    (None, list(warm.DEFAULT_MODULES)), ("none", []), ("", []), (" a.b , c ,", ["a.b", "c"]),
])
def test_pipeline_preload_names_the_modules(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("PIPELINE_PRELOAD", raising=False)
    else:
        monkeypatch.setenv("PIPELINE_PRELOAD", value)
    assert warm.modules() == expected


def test_preload_in_background_imports_on_its_own_thread():
    sys.modules.pop("this", None)
    thread = warm.preload_in_background(["this"])  # the Zen of Python: a module nothing else imports
    thread.join(60)
    assert not thread.is_alive() and thread.daemon and thread.name == "pipeline-preload"
    assert "this" in sys.modules


def test_a_deferred_preload_waits_for_its_event_and_runs_at_low_priority(monkeypatch, tmp_path):
    """make demo's: nothing imported until the train task waits for its ranks (the supervisor's WAITING),
    then on a thread whose own niceness is raised, and its session's while it imports, so that the ranks
    (each in a session of its own) keep the cores; the session's niceness is set back afterwards."""
    import os
    import threading

    autogroup = tmp_path / "autogroup"
    autogroup.write_text("/autogroup-7 nice 0\n")
    monkeypatch.setattr(warm, "AUTOGROUP", autogroup)
    seen: dict[str, object] = {}

    def preload(names):
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        seen["process"] = os.getpriority(os.PRIO_PROCESS, os.getpid())  # the main thread's
        seen["session"] = autogroup.read_text()

    monkeypatch.setattr(warm, "preload", preload)
    go = threading.Event()
    thread = warm.preload_in_background(["this"], after=go, nice=5)
    thread.join(0.3)
    assert thread.is_alive() and not seen  # still waiting
    go.set()
    thread.join(60)
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    assert seen == {"nice": min(base + 5, 19), "process": base, "session": "5"}  # the thread's, not the process's
    assert autogroup.read_text() == "0"


SESSION = """
from pipeline.airflow import warm

def niceness():
    return open("/proc/self/autogroup").read().split()[-1]

seen = []
warm.preload = lambda names: seen.append(niceness())
warm.preload_in_background(["this"], nice=19).join(60)
print(seen[0], niceness())
"""


@pytest.mark.skipif(not warm.AUTOGROUP.exists(), reason="no autogroup scheduling on this kernel")
def test_the_session_is_niced_only_while_the_preload_imports():
    """On the real /proc/self/autogroup, in a session of its own (this one's is left alone)."""
    before = warm.AUTOGROUP.read_text()
    done = subprocess.run([sys.executable, "-c", SESSION], capture_output=True, text=True, timeout=300,
                          start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["19", "0"]
    assert warm.AUTOGROUP.read_text() == before


def test_a_session_already_niced_is_left_as_it_is(monkeypatch, tmp_path):
    """Two demos from one shell: the second finds the first's 19 and must not set it back to 19 after the first
    has set it back to 0."""
    autogroup = tmp_path / "autogroup"
    autogroup.write_text("/autogroup-7 nice 19\n")
    monkeypatch.setattr(warm, "AUTOGROUP", autogroup)
    with warm.session_niceness(19):
        autogroup.write_text("/autogroup-7 nice 0\n")  # the first demo's preload is done
    assert autogroup.read_text() == "/autogroup-7 nice 0\n"


def test_a_session_niceness_that_cannot_be_set_changes_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(warm, "AUTOGROUP", tmp_path / "missing")
    with warm.session_niceness(19):
        pass
    assert not (tmp_path / "missing").exists()


def test_a_task_waits_for_a_preload_that_is_importing(tmp_path, monkeypatch):
    """make demo's tasks run in the preloading process: a task that looked a module up in sys.modules while the
    thread imported it found it half-imported (matplotlib.use and matplotlib.pyplot failed an evaluate task)."""
    import threading
    import time

    (tmp_path / "slow_to_import.py").write_text("import time\ntime.sleep(1.0)\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "slow_to_import", raising=False)
    go = threading.Event()
    thread = warm.preload_in_background(["slow_to_import"], after=go)
    warm.settled()  # a preload still waiting for its event holds nothing up (make demo's first task)
    assert "slow_to_import" not in sys.modules
    go.set()
    while "slow_to_import" not in sys.modules and thread.is_alive():
        time.sleep(0.005)
    assert not hasattr(sys.modules["slow_to_import"], "DONE")  # half-imported, as the failing task saw it
    warm.settled()
    assert sys.modules["slow_to_import"].DONE
    thread.join(60)


def test_preloading_mlflow_also_maps_the_installed_distributions_once():
    """log_model's requirement check maps every installed distribution (about 1.2 s) in each process that logs
    its first model; a warm process has the map already. (A fresh process: MLflow keeps the map in a global.)"""
    import subprocess

    script = ("from pipeline.airflow import warm\n"
              "from mlflow.utils import requirements_utils as r\n"
              "assert r._MODULES_TO_PACKAGES is None\n"
              "warm.preload(['mlflow.pyfunc'])\n"
              "print(sorted(r._MODULES_TO_PACKAGES.get('torch', [])))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "['torch']"


def test_a_failing_step_after_an_import_is_logged_and_skipped(monkeypatch, caplog):
    def broken():
        raise RuntimeError("no map today")

    monkeypatch.setitem(warm.AFTER_IMPORT, "this", broken)
    with caplog.at_level("WARNING"):
        took = warm.preload(["this", "json"])
    assert list(took) == ["json"]
    assert "preloading this failed: RuntimeError: no map today" in caplog.text
