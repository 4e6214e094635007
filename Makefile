# The README's commands: `make run` (the main job) and `make test` (all tests
# on the newest supported toolchain, then the smoke set on the oldest).
# `scripts/setup.sh` creates each venv with python3.12 when it is missing and
# brings it to its constraints file (.venv: constraints.txt, the newest;
# .venv-oldest: constraints-oldest.txt); on a machine with an NVIDIA driver it
# installs JAX's CUDA plugin too.
# `make gpu-check`: the GPU check (needs a GPU; docs/benchmarks.md).
# `make perf-baselines`: re-records the performance contracts' baselines.
PY := .venv/bin/python
OLDEST := .venv-oldest/bin/python

.PHONY: setup setup-oldest run test test-newest test-oldest gpu-check perf-baselines
setup:
	@bash scripts/setup.sh

setup-oldest:
	@bash scripts/setup.sh .venv-oldest constraints-oldest.txt

run: setup
	$(PY) -m benchmarks --quick

test: test-newest test-oldest

test-newest: setup
	$(PY) -m pytest -n 2 -q tests

test-oldest: setup-oldest
	$(OLDEST) -m pytest -n 2 -q -p no:cacheprovider tests/pallas/test_smoke.py

gpu-check: setup
	$(PY) -m benchmarks.gpu_check

# Re-records the performance contracts' baselines (docs/performance.md).
perf-baselines: setup
	$(PY) -m tests.pallas.perf_contracts --record
