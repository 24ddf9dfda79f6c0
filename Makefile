# Everyday tasks; each runs what .ci/run runs (or a part of it) with the venv's tools.
# `make venv` first (the README's install); BENCH=<name> picks the benchmark `make bench` runs.
VENV ?= .venv
PY := $(VENV)/bin/python
BENCH ?= cli_start

.PHONY: venv test lint docs bench bench-plot

venv:
	python3 -m venv $(VENV) && $(VENV)/bin/pip install -q -e '.[test]'

# The whole suite, two lanes (as CI). One file: make test TESTS=tests/unit/test_layers.py
TESTS ?=
test:
	$(PY) -m pytest -n 2 $(TESTS)

# What .ci/run checks beside the tests.
lint:
	$(PY) -m tests.compose_stack
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -n 0 tests/unit/test_layers.py tests/unit/test_docs_paths.py

docs:
	$(VENV)/bin/mkdocs build --strict

# One benchmark (benchmarks/README.md lists them and their commands); it prints its figures and
# a calibration line, and its sitting goes into benchmarks/history.jsonl by hand.
bench:
	$(PY) benchmarks/$(BENCH).py

# The docs site's plot of benchmarks/history.jsonl (needs the `bench` extra: matplotlib).
bench-plot:
	$(PY) benchmarks/plot_history.py
