#!/usr/bin/env bash
# One-time set-up: a venv with python3.12 and the toolchain a constraints
# file pins, plus spin; on a machine with an NVIDIA driver, JAX's CUDA plugin
# matching it.
#
#   scripts/setup.sh                                   # .venv, constraints.txt
#   scripts/setup.sh .venv-oldest constraints-oldest.txt
#
# A venv that exists but holds another toolchain is brought to the pinned one.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
CONSTRAINTS="${2:-constraints.txt}"

find_python312() {
  if python3.12 -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null; then
    command -v python3.12; return
  fi
  # pyenv: the shim needs a version selected; use the installed 3.12 directly.
  local root
  root="$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"
  for p in "$root"/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if [ -x "$p" ]; then echo "$p"; return; fi
  done
  echo "error: python3.12 not found (install it, e.g. with pyenv)" >&2
  exit 1
}

if [ ! -x "$VENV/bin/python" ]; then
  "$(find_python312)" -m venv "$VENV"
fi
if ! "$VENV/bin/python" scripts/toolchain.py "$CONSTRAINTS" \
    || ! "$VENV/bin/python" -c "import jax, triton, pytest, hypothesis, xdist, matplotlib, absl, dsl" 2>/dev/null; then
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet -c "$CONSTRAINTS" -e ".[test,bench]"
fi
# NVIDIA GPU: the installed jax's cuda12 or cuda13 plugin, by the CUDA version
# the driver supports (scripts/cuda_extra.py), so JAX runs on the GPU.
if command -v nvidia-smi >/dev/null 2>&1; then
  cuda_req="$("$VENV/bin/python" scripts/cuda_extra.py --missing)"
  if [ -n "$cuda_req" ]; then
    echo "set-up: installing $cuda_req" >&2
    "$VENV/bin/pip" install --quiet -c "$CONSTRAINTS" "$cuda_req" \
      || echo "warning: could not install $cuda_req; JAX runs on the CPU" >&2
  fi
  "$VENV/bin/python" scripts/cuda_extra.py --verify || true
fi
if ! command -v spin >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq spin >/dev/null) \
      || echo "warning: could not install spin; verification tests will skip" >&2
  else
    echo "warning: spin missing (apt-get install spin); verification tests will skip" >&2
  fi
fi
