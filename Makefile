# Two commands on a fresh machine: `make demo` (the main job; RECIPE=name for another) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
RECIPE ?= tabular_mlp

.PHONY: demo test airflow venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "Python 3.11 is required (set PYTHON=...)")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

demo: venv
	$(PY) -m pipeline.demo --recipe $(RECIPE) $(ARGS)

test: venv
	$(PY) -m pytest $(ARGS)

# The airflow CLI on the embedded settings, e.g. make airflow ARGS="dags list" or ARGS=standalone
airflow: venv
	$(PY) -m pipeline.airflow_cli $(ARGS)

clean:
	rm -rf var
