"""Mosaic GPU kernels exported for CUDA on any machine, checked on a GPU.

    python scripts/mosaic_gpu_export.py export out/mosaic_gpu   # CPU is fine
    python scripts/mosaic_gpu_export.py check out/mosaic_gpu    # needs a GPU

`export` lowers each sample kernel (benchmarks/mosaic_gpu_kernels.py:
elementwise, matmul, softmax, attention) for "cuda" through backend
"mosaic_gpu" (`jax.export(..., platforms=("cuda",))`) and writes, per
kernel, the
StableHLO text (`NAME.stablehlo.mlir`, holding the `mosaic_gpu_v2` custom
call), the serialized export (`NAME.jax_exported`, when the `flatbuffers`
package is installed), the inputs and the jnp reference (`NAME.npz`), and
`manifest.json`. `check` runs each export on the GPU (or, without the
serialized file, the same kernel freshly jitted) and compares with the
reference. Numerics are only known after `check` has run on a GPU.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.mosaic_gpu_kernels import CASES  # noqa: E402


def export(out_dir: str) -> None:
  os.makedirs(out_dir, exist_ok=True)
  manifest = {}
  for name, (fn, ref, make, atol) in CASES.items():
    args = make()
    exp = jax.export.export(jax.jit(fn), platforms=("cuda",))(*args)
    with open(os.path.join(out_dir, f"{name}.stablehlo.mlir"), "w") as fh:
      fh.write(exp.mlir_module())
    serialized = None
    try:
      serialized = exp.serialize()
    except ImportError as e:           # flatbuffers is not installed
      print(f"{name}: not serialized ({e})")
    if serialized is not None:
      with open(os.path.join(out_dir, f"{name}.jax_exported"), "wb") as fh:
        fh.write(serialized)
    expected = np.asarray(ref(*args).astype(jnp.float32))
    np.savez(os.path.join(out_dir, f"{name}.npz"), expected=expected,
             **{f"arg{i}": np.asarray(a.astype(jnp.float32))
                for i, a in enumerate(args)})
    manifest[name] = {"dtypes": [str(a.dtype) for a in args],
                      "shapes": [list(a.shape) for a in args], "atol": atol,
                      "serialized": serialized is not None}
    print(f"{name}: exported ({len(exp.mlir_module_serialized)} bytes of "
          "StableHLO)")
  with open(os.path.join(out_dir, "manifest.json"), "w") as fh:
    json.dump(manifest, fh, indent=1)


def check(out_dir: str) -> int:
  if not any(d.platform == "gpu" for d in jax.devices()):
    print("check needs a CUDA GPU visible to JAX")
    return 2
  with open(os.path.join(out_dir, "manifest.json")) as fh:
    manifest = json.load(fh)
  failures = 0
  for name, info in manifest.items():
    data = np.load(os.path.join(out_dir, f"{name}.npz"))
    args = [jnp.asarray(data[f"arg{i}"]).astype(d)
            for i, d in enumerate(info["dtypes"])]
    path = os.path.join(out_dir, f"{name}.jax_exported")
    if info["serialized"] and os.path.exists(path):
      with open(path, "rb") as fh:
        out = jax.export.deserialize(bytearray(fh.read())).call(*args)
    else:
      out = jax.jit(CASES[name][0])(*args)
    err = float(np.max(np.abs(np.asarray(out, np.float32) - data["expected"])))
    ok = err <= info["atol"]
    failures += not ok
    print(f"{name}: max abs error {err:.3g} (atol {info['atol']}) "
          f"{'ok' if ok else 'FAIL'}")
  return 1 if failures else 0


if __name__ == "__main__":
  mode = sys.argv[1] if len(sys.argv) > 1 else "export"
  directory = sys.argv[2] if len(sys.argv) > 2 else "out/mosaic_gpu"
  if mode == "export":
    export(directory)
  elif mode == "check":
    sys.exit(check(directory))
  else:
    sys.exit(f"usage: {sys.argv[0]} export|check [DIR]")
