"""A task's process started fresh: a Celery worker preloading the modules when it starts (through the configuration
Airflow resolves from ``[celery] celery_config_options``), the real session niceness while the preload imports,
MLflow's distribution map made by the preload, and MLflow's log lines routed to the task log. What
pipeline.airflow.preload does within one process is in tests/unit/test_preload.py."""

import os
import subprocess
import sys

import pytest

from pipeline import deployment
from pipeline.airflow import preload

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
    env = {**os.environ, "AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS": "pipeline.airflow.preload.CELERY_CONFIG",
           "PIPELINE_PRELOAD": "wave, pipeline_no_such_module,colorsys"}
    done = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "imported"
    # The module that does not exist is reported and skipped; the others are still imported.
    assert any("preloading pipeline_no_such_module failed: ModuleNotFoundError" in line for line in lines), lines
    assert any("preloaded wave, colorsys in " in line for line in lines), lines


SESSION = """
from pipeline.airflow import preload

def niceness():
    return open("/proc/self/autogroup").read().split()[-1]

seen = []
preload.preload = lambda names: seen.append(niceness())
preload.preload_in_background(["this"], nice=19).join(60)
print(seen[0], niceness())
"""


@pytest.mark.skipif(not preload.AUTOGROUP.exists(), reason="no autogroup scheduling on this kernel")
def test_the_session_is_niced_only_while_the_preload_imports():
    """On the real /proc/self/autogroup, in a session of its own (this one's is left alone)."""
    before = preload.AUTOGROUP.read_text()
    done = subprocess.run([sys.executable, "-c", SESSION], capture_output=True, text=True, timeout=300,
                          start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["19", "0"]
    assert preload.AUTOGROUP.read_text() == before


def test_preloading_mlflow_also_maps_the_installed_distributions_once():
    """log_model's requirement check maps every installed distribution (about 1.2 s) in each process that logs
    its first model; a warm process has the map already. (A fresh process: MLflow keeps the map in a global.)"""
    import subprocess

    script = ("from pipeline.airflow import preload\n"
              "from mlflow.utils import requirements_utils as r\n"
              "assert r._MODULES_TO_PACKAGES is None\n"
              "preload.preload(['mlflow.pyfunc'])\n"
              "print(sorted(r._MODULES_TO_PACKAGES.get('torch', [])))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "['torch']"


def test_mlflow_lines_reach_the_task_log_at_their_level_not_as_stderr():
    """MLflow configures its logger at import to print to stderr, which Airflow logs as ERROR lines."""
    code = (
        "import logging, sys\n"
        "import mlflow\n"
        "records = []\n"
        "class Keep(logging.Handler):\n"
        "    def emit(self, record): records.append((record.levelname, record.name))\n"
        "if sys.argv[1] == 'routed':\n"
        "    from pipeline.airflow.tasks import route_mlflow_logging\n"
        "    route_mlflow_logging()\n"
        "logging.getLogger().addHandler(Keep()); logging.getLogger().setLevel(logging.DEBUG)\n"
        "logging.getLogger('mlflow.pyfunc').info('Validating input example against model signature')\n"
        "print([r for r in records if r[1].startswith('mlflow')])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(deployment.PROJECT_ROOT)}
    env.pop("MLFLOW_CONFIGURE_LOGGING", None)
    plain = subprocess.run([sys.executable, "-c", code, "plain"], capture_output=True, text=True, env=env, timeout=120)
    assert "INFO mlflow.pyfunc: Validating input example" in plain.stderr  # what a task log showed as ERROR
    routed = subprocess.run([sys.executable, "-c", code, "routed"], capture_output=True, text=True, env=env, timeout=120)
    assert routed.returncode == 0, routed.stderr
    assert "Validating input example" not in routed.stderr
    assert "[('INFO', 'mlflow.pyfunc')]" in routed.stdout
