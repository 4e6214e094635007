# The README's commands: `make run` (the main job) and `make test` (all tests);
# `make perf-baselines` re-records the performance contracts' baselines.
# Each first creates .venv with python3.12 when it is missing.
PY := .venv/bin/python

.PHONY: setup run test perf-baselines
setup:
	@bash scripts/setup.sh

run: setup
	$(PY) -m benchmarks --quick

test: setup
	$(PY) -m pytest -n 2 -q tests

# Re-records the performance contracts' baselines (docs/performance.md).
perf-baselines: setup
	$(PY) -m tests.pallas.perf_contracts --record
