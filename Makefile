# Two commands on a fresh machine: `make demo` (the main job; RECIPE=name for another, LAUNCH=ray for Ray Train) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
RECIPE ?= tabular_mlp
LAUNCH ?= local

.PHONY: demo test test-fast airflow venv clean ui stack stack-down stack-env toolchain

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "Python 3.11 is required (set PYTHON=...)")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

demo: venv
	$(PY) -m pipeline.dev.demo --recipe $(RECIPE) --launch $(LAUNCH) $(ARGS)

# The suite in LANES pytest-xdist workers side by side (LANES=0: one process); tests/conftest.py groups them.
LANES ?= 2
test: venv
	bash tests/system-packages.sh
	$(PY) -m pytest -n $(LANES) --dist loadgroup --no-loadscope-reorder $(ARGS)

# The unit and DAG-integrity tests less the slow ones (marker slow), in the same lanes: a few minutes, no service,
# no system package (docs/testing.md).
test-fast: venv
	$(PY) -m pytest -n $(LANES) --dist loadgroup --no-loadscope-reorder -m "not slow" tests/unit tests/dags $(ARGS)

# A third-party toolchain's own environment (toolchains/NAME: unsloth, axolotl, llm_foundry; NAME=all for every
# one), built once per lock into a cache outside the clone (PIPELINE_TOOLCHAIN_CACHE, default ~/.cache/ddp-pipelines).
NAME ?= all
toolchain: venv
	$(PY) -m pipeline.toolchains build $(NAME)

# The airflow CLI on the embedded settings, e.g. make airflow ARGS="dags list" or ARGS=standalone
airflow: venv
	$(PY) -m pipeline.dev.airflow_cli $(ARGS)

# The embedded default with its UIs in the foreground: Airflow on 127.0.0.1:8080, MLflow on :5000; Ctrl-C stops all.
ui: venv
	$(PY) -m pipeline.dev.stack ui

# The deployment's topology as local processes (Celery on this machine's Redis, PostgreSQL, MLflow server);
# RAY=1 adds a Ray head on 127.0.0.1 for launch.kind=ray (the ray_default connection); S3=1 an S3 API server
# (bucket pipeline: MLflow's artifacts and the dataset versions; the aws_default connection).
stack: venv
	$(PY) -m pipeline.dev.stack up $(if $(filter 1 yes true,$(RAY)),--ray) $(if $(filter 1 yes true,$(S3)),--s3)

stack-down: venv
	$(PY) -m pipeline.dev.stack down

# Secrets for docker-compose.yml: .env beside it (mode 0600), kept when it exists.
stack-env:
	$(PYTHON) -m pipeline.dev.stack.secrets .env

clean:
	rm -rf var
