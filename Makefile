# The README's commands: `make run` (the main job) and `make test` (all tests).
# Each first creates .venv with python3.12 when it is missing.
PY := .venv/bin/python

.PHONY: setup run test
setup:
	@bash scripts/setup.sh

run: setup
	$(PY) -m benchmarks --quick

test: setup
	$(PY) -m pytest -n 2 -q tests
