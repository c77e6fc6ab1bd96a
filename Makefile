# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "Python 3.11 is required (set PYTHON=...)")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

demo: venv
	$(PY) -m pipeline.demo $(ARGS)

test: venv
	$(PY) -m pytest $(ARGS)

clean:
	rm -rf var
