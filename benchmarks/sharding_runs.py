"""`python -m benchmarks --sharding`: a kernel that partitions itself under a
sharded `jax.jit`, beside the same kernel inside `jax.shard_map` and the
replicated run, on 8 host devices (CPU) or the devices there are.

    sharded     jax.jit(kernel) on inputs sharded over the rows: each device
                runs the kernel on its rows (dsl/transforms/partitioning.py)
    shard_map   the same kernel, for one device's rows, in jax.shard_map
    replicated  jax.jit(kernel) on replicated inputs: every device runs the
                whole kernel

Rows: softmax and layer_norm (benchmarks/suite/rowwise.py) per backend.
"""
from __future__ import annotations

import os

DEVICES = 8
IMPLS = ("sharded", "shard_map", "replicated")


def ensure_host_devices(n: int = DEVICES) -> None:
  """Asks XLA for `n` host devices, if no backend has started yet."""
  flag = "--xla_force_host_platform_device_count"
  from dsl.core.jax_internals import xla_bridge
  if xla_bridge.backends_are_initialized() or flag in os.environ.get(
      "XLA_FLAGS", ""):
    return
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" {flag}={n}").strip()


def _all_gathers(compiled_text: str) -> int:
  """All-gathers of data (not the host backends' s32 failure flag)."""
  import re
  return sum(1 for line in compiled_text.splitlines()
             if "all-gather(" in line
             and not re.search(r"= (s32|u32|pred)\[", line))


def _impls(bench, backend, size, dtype, config, mesh):
  import dsl
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P
  n = mesh.size
  rows, cols = size
  whole = bench.build(dsl, size, dtype, config, backend=backend)
  local = bench.build(dsl, (rows // n, cols), dtype, config, backend=backend)
  args = bench.inputs(size, dtype)
  row_specs = (P("x"),) + (P(),) * (len(args) - 1)
  sharded = tuple(jax.device_put(a, NamedSharding(mesh, s))
                  for a, s in zip(args, row_specs))
  replicated = tuple(jax.device_put(a, NamedSharding(mesh, P())) for a in args)
  in_shard_map = jax.shard_map(local, mesh=mesh, in_specs=row_specs,
                               out_specs=P("x"), check_vma=False)
  return args, {"sharded": (whole, sharded),
                "shard_map": (in_shard_map, sharded),
                "replicated": (whole, replicated)}


def measure_row(bench, backend, size, dtype, repeats):
  import jax
  import numpy as np
  from benchmarks import timing
  from benchmarks.suite.base import max_rel_err
  mesh = jax.make_mesh((jax.device_count(),), ("x",))
  # One block size for all three: the one chosen for a device's rows.
  config = bench.default_config((size[0] // mesh.size, size[1]), backend,
                                "cpu")
  args, impls = _impls(bench, backend, size, dtype, config, mesh)
  want = np.asarray(bench.reference(*args))
  row = {"kernel": bench.name, "size": "x".join(map(str, size)),
         "backend": backend, "devices": mesh.size, "config": config}
  for name, (fn, xs) in impls.items():
    text = jax.jit(fn).lower(*xs).compile().as_text()
    stats = timing.measure(fn, xs, warmup=1, repeats=repeats)
    err = max_rel_err(np.asarray(stats.output), want)
    row[name] = {"median_s": stats.median, "all_gathers": _all_gathers(text),
                 "max_rel_err": err,
                 "ok": bool(err <= bench.tolerance(dtype))}
  return row


def render(rows) -> str:
  head = (f"{'kernel':<11} {'size':<10} {'backend':<17} "
          + " ".join(f"{n + ' ms':>13}" for n in IMPLS)
          + f" {'vs shard_map':>12} {'vs repl.':>9} {'gathers':>8} check")
  lines = [head, "-" * len(head)]
  for r in rows:
    t = {n: r[n]["median_s"] for n in IMPLS}
    ok = all(r[n]["ok"] for n in IMPLS)
    lines.append(
        f"{r['kernel']:<11} {r['size']:<10} {r['backend']:<17} "
        + " ".join(f"{t[n] * 1e3:>13.2f}" for n in IMPLS)
        + f" {t['sharded'] / t['shard_map']:>11.2f}x"
        + f" {t['replicated'] / t['sharded']:>8.2f}x"
        + f" {r['sharded']['all_gathers']:>8d} {'ok' if ok else 'MISMATCH'}")
  lines.append(f"{rows[0]['devices'] if rows else DEVICES} devices; "
               "vs shard_map: sharded time / shard_map time (1.00x: no "
               "overhead); vs repl.: replicated time / sharded time; "
               "gathers: all-gathers of data in the sharded program")
  return "\n".join(lines)


def run(args) -> int:
  ensure_host_devices()
  import json
  import jax.numpy as jnp
  from benchmarks.sizes import parse_sizes
  from benchmarks.suite import by_name
  from dsl.core import backends as dsl_backends
  backends = (args.backends.split(",") if args.backends
              else [b for b in dsl_backends.BACKENDS
                    if dsl_backends.REGISTRY[b].on_host])
  kernels = args.kernels.split(",") if args.kernels else ["softmax",
                                                           "layer_norm"]
  sizes = parse_sizes(args.sizes) if args.sizes else [(1024, 1024)]
  dtype = jnp.dtype(args.dtype or "float32")
  rows = []
  benches = by_name()
  for k in kernels:
    for size in sizes:
      for backend in backends:
        rows.append(measure_row(benches[k], backend, tuple(size), dtype,
                                args.repeats or 5))
  print(render(rows))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"sharding": rows}, f, indent=1)
  bad = [r for r in rows if not all(r[n]["ok"] for n in IMPLS)
         or r["sharded"]["all_gathers"]]
  return 1 if bad else 0
