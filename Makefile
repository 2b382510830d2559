# The two commands of README.md:
#   make quickstart   set up, then run the CPU RL job that visibly learns (trainer issue)
#   make test         set up, then run the whole test suite (what .ci/run calls)
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test test-fast quickstart bench

setup:
	bash tests/setup/all.sh

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

quickstart: setup
	$(PY) -m megarl.cli train examples/quickstart.yaml

bench: setup
	@set -e; for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b; done
