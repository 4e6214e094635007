# The README's commands: `make run` (the main job) and `make test` (all tests).
# Each first creates .venv with python3.12 when it is missing (and, on a
# machine with an NVIDIA driver, installs JAX's CUDA plugin).
# `make gpu-check`: the GPU check (needs a GPU; docs/benchmarks.md).
# `make perf-baselines`: re-records the performance contracts' baselines.
PY := .venv/bin/python

.PHONY: setup run test gpu-check perf-baselines
setup:
	@bash scripts/setup.sh

run: setup
	$(PY) -m benchmarks --quick

test: setup
	$(PY) -m pytest -n 2 -q tests

gpu-check: setup
	$(PY) -m benchmarks.gpu_check

# Re-records the performance contracts' baselines (docs/performance.md).
perf-baselines: setup
	$(PY) -m tests.pallas.perf_contracts --record
