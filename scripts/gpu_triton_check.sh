#!/usr/bin/env bash
# GPU check of the Triton backend: the GPU-marked tests, then the benchmark
# (bf16 matmul 4096^3 vs jnp.dot and jax.experimental.pallas; softmax and
# layer norm vs the measured copy bandwidth). Run from anywhere on a machine
# with a CUDA GPU and jax[cuda12] installed:
#
#   bash scripts/gpu_triton_check.sh            # tests + full benchmark
#   QUICK=1 bash scripts/gpu_triton_check.sh    # tests + small benchmark
#
# Results go to stdout and to $OUT_DIR (default: ./out/gpu_triton).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT_DIR=${OUT_DIR:-out/gpu_triton}
mkdir -p "$OUT_DIR"

"$PY" - <<'PYEOF' || exit 2
import sys
import jax, triton
print("jax", jax.__version__, "triton", triton.__version__)
print("devices:", jax.devices())
if not any(d.platform == "gpu" for d in jax.devices()):
    sys.exit("no CUDA device visible to JAX: install the CUDA plugin "
             "(pip install 'jax[cuda12]==0.11.2') on a GPU machine")
PYEOF

status=0
"$PY" -m pytest -m gpu -q -p no:cacheprovider tests/pallas/test_triton_gpu.py \
  --junitxml="$OUT_DIR/gpu_tests.xml" 2>&1 | tee "$OUT_DIR/gpu_tests.txt" || status=1

bench_args=(--json "$OUT_DIR/benchmark.json")
[ "${QUICK:-0}" = "1" ] && bench_args+=(--quick)
"$PY" benchmarks/gpu_triton.py "${bench_args[@]}" 2>&1 \
  | tee "$OUT_DIR/benchmark.txt" || status=1
exit $status
