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
