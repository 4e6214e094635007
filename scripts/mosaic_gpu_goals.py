"""The Hopper goals of the Mosaic GPU backend, measured in one run (bf16):

  matmul 4096^3, 8192^3          kernels.matmul          vs jnp.dot (cuBLAS)
  attention fwd, fwd+bwd         kernels.flash_attention vs cuDNN
    batch 4, 16 heads, head_dim 128, seq 2048 and 8192, causal and not
  softmax, layer norm, rms norm  kernels.*               vs a 1 GiB copy
  the sample matmul 4096^3 under each schedule (mosaic_gpu_kernels.SCHEDULES)

    python scripts/mosaic_gpu_goals.py [--json out.json]   # on an H100/H200
    python scripts/mosaic_gpu_goals.py --lower-only        # any machine

`--lower-only` lowers every case for CUDA (the modules are built and
layout-inferred) and prints each one's schedule, without timing: the check
that the GPU run will not stop on a lowering error.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import kernels  # noqa: E402
from lowering_mosaic.gpu import to_gpu_modules  # noqa: E402
from benchmarks import mosaic_gpu_kernels as samples  # noqa: E402

BACKEND = "mosaic_gpu"
ROW_SHAPES = ((8192, 8192), (131072, 512))


def _normal(seed, *shapes):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return [jax.random.normal(k, s, jnp.float32).astype(jnp.bfloat16)
          for k, s in zip(keys, shapes)]


def _abstract(seed, *shapes):
  """Inputs for lowering only: shapes, no data."""
  return [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]


def _loss(f):
  return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)),
                  tuple(range(3)))


def cases(inputs=_normal):
  """(name, ours, peer or None, inputs, flops or bytes, unit); `inputs`
  makes the arrays (seed, *shapes)."""
  out = []
  for n in (4096, 8192):
    x, y = inputs(0, (n, n), (n, n))
    out.append((f"matmul {n}^3", functools.partial(
        kernels.matmul, backend=BACKEND), jnp.dot, (x, y), 2 * n ** 3,
                "TFLOP/s"))
  for s in (2048, 8192):
    q, k, v = inputs(1, *[(4, s, 16, 128)] * 3)
    for causal in (False, True):
      ours = functools.partial(kernels.flash_attention, causal=causal,
                               backend=BACKEND)
      cudnn = functools.partial(jax.nn.dot_product_attention,
                                is_causal=causal, implementation="cudnn")
      flops = 4 * 4 * 16 * s * s * 128 * (0.5 if causal else 1.0)
      tag = f"attention {'causal ' if causal else ''}seq {s}"
      out.append((f"{tag} fwd", ours, cudnn, (q, k, v), flops, "TFLOP/s"))
      out.append((f"{tag} fwd+bwd", _loss(ours), _loss(cudnn), (q, k, v),
                  3.5 * flops, "TFLOP/s"))
  for shape in ROW_SHAPES:
    x, w, b = inputs(2, shape, shape[-1:], shape[-1:])
    nbytes = 2 * math.prod(shape) * 2
    for name, fn in (
        ("softmax", lambda x: kernels.softmax(x, backend=BACKEND)),
        ("layer_norm", lambda x, w=w, b=b: kernels.layer_norm(
            x, w, b, backend=BACKEND)),
        ("rms_norm", lambda x, w=w: kernels.rms_norm(x, w,
                                                     backend=BACKEND))):
      out.append((f"{name} {shape[0]}x{shape[1]}", fn, None, (x,), nbytes,
                  "GB/s"))
  x, y = inputs(3, (4096, 4096), (4096, 4096))
  for sched, params in {"lowering's choice": {}, **samples.SCHEDULES}.items():
    out.append((f"sample matmul 4096^3 ({sched})", functools.partial(
        samples.matmul, **params), jnp.dot, (x, y), 2 * 4096 ** 3,
                "TFLOP/s"))
  return out


def lower_only() -> int:
  failures = 0
  for name, ours, _, args, _, _ in cases(_abstract):
    try:
      mods = to_gpu_modules(ours, *args)
      print(f"{name}: " + "; ".join(f"{m.plan.schedule.describe()}, CUDA "
                                     f"grid {m.plan.cuda_grid}" for m in mods))
    except Exception as e:  # noqa: BLE001 (reported, then the next case)
      failures += 1
      print(f"{name}: does not lower: {type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]}")
  return 1 if failures else 0


def measure(json_path=None) -> int:
  from benchmarks.gpu_attention import timed_or_reason, copy_bandwidth
  bw = copy_bandwidth()
  print(f"1 GiB copy: {bw / 1e9:.0f} GB/s ({jax.devices()[0].device_kind})")
  rows = []
  for name, ours, peer, args, work, unit in cases():
    t, err = timed_or_reason(name, jax.jit(ours), *args)
    tp, perr = (timed_or_reason(name, jax.jit(peer), *args) if peer
                else (None, None))
    rate = t and work / t / (1e12 if unit == "TFLOP/s" else 1e9)
    ratio = (tp / t if tp and t else None) if peer else (
        t and work / t / bw)
    rows.append(dict(case=name, ms=t and t * 1e3, rate=rate, unit=unit,
                     peer_ms=tp and tp * 1e3, ratio=ratio, error=err,
                     peer_error=perr))
    if err:
      msg = err
    elif ratio is None:
      msg = f"{t * 1e3:.3f} ms, {rate:.0f} {unit} (peer: {perr})"
    else:
      what = "x the peer's speed" if peer else "of the copy bandwidth"
      msg = f"{t * 1e3:.3f} ms, {rate:.0f} {unit}, {ratio:.2f} {what}"
    print(f"{name}: {msg}")
  if json_path:
    with open(json_path, "w") as fh:
      json.dump(dict(device=jax.devices()[0].device_kind, copy_GBps=bw / 1e9,
                     rows=rows), fh, indent=1)
  return 0


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--lower-only", action="store_true")
  p.add_argument("--json")
  a = p.parse_args(argv)
  if a.lower_only:
    return lower_only()
  if jax.default_backend() != "gpu":
    print("needs a GPU; use --lower-only elsewhere", file=sys.stderr)
    return 2
  return measure(a.json)


if __name__ == "__main__":
  sys.exit(main())
