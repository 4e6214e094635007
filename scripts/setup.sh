#!/usr/bin/env bash
# One-time set-up: .venv with python3.12 and the pinned toolchain, plus spin.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3.12 -m venv .venv
fi
if ! .venv/bin/python -c "import jax, triton, pytest, hypothesis, xdist, matplotlib, absl, dsl" 2>/dev/null; then
  .venv/bin/pip install --quiet --upgrade pip
  .venv/bin/pip install --quiet -e ".[test,bench]"
fi
if ! command -v spin >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq spin >/dev/null) || echo "warning: could not install spin"
fi
