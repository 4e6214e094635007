"""One process of a two-process JAX job (test_multiprocess.py starts two).

    python -m tests.pallas.multiprocess_worker RANK PORT OUT.json CACHE.json \
        BACKEND[,BACKEND...]

Each process has one CPU device; `jax.distributed` joins them into one job
of two devices (gloo collectives). On every CPU backend the process runs a
partitioned kernel under a sharded `jax.jit`, its gradient, and a ring of
two devices inside `shard_map`; and an autotuned kernel whose cache file
differs between the processes. What it saw goes to OUT.json as numbers
(this process's shards and the choices it made), for the test to compare.
"""
from __future__ import annotations

import functools
import json
import os
import sys


def _setup(rank: int, port: str, cache: str):
  os.environ["DSL_AUTOTUNE_CACHE"] = cache
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"localhost:{port}", num_processes=2,
                             process_id=rank, initialization_timeout=60)
  return jax


def _kernels(pl):
  import jax
  import jax.numpy as jnp
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))

  def scale_add(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + y_ref[...]

  def call(backend, x, y):
    return pl.pallas_call(scale_add, jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(x.shape[0] // 8,), in_specs=[spec, spec],
                          out_specs=spec, backend=backend)(x, y)

  def per_shard(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0

  def shard_call(backend, x):
    return pl.pallas_call(per_shard, jax.ShapeDtypeStruct(x.shape, x.dtype),
                          backend=backend)(x)
  del jnp
  return call, shard_call


def _partitioned(jax, mesh, call, backend, rank):
  """A kernel partitioned over the two processes' devices, and its grad."""
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  sharding = NamedSharding(mesh, P("x"))
  local = np.arange(16 * 128, dtype=np.float32).reshape(16, 128) + 1000 * rank
  x = jax.make_array_from_process_local_data(sharding, local)
  f = functools.partial(call, backend)
  out = jax.jit(f)(x, x)
  grad = jax.jit(jax.grad(lambda x: jnp.sum(f(x, x) ** 2)))(x)
  shard = lambda a: np.asarray(a.addressable_shards[0].data).tolist()
  return {"out": shard(out), "grad": shard(grad),
          "out_sharding": str(out.sharding.spec)}


def _ring(jax, mesh, shard_call, backend, rank):
  """A ring of the two devices inside shard_map: the all_gather kernel's
  remote DMAs where the backend has them, else a kernel per shard and a
  ppermute."""
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  import kernels
  local = np.full((8, 128), rank + 1.0, np.float32)
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")),
                                             local)
  if backend == "triton_interpret":     # no remote DMAs in Triton
    def body(s):
      s = shard_call(backend, s)
      return jax.lax.ppermute(s, "x", [(0, 1), (1, 0)])
  else:
    body = functools.partial(kernels.all_gather, axis_name="x",
                             backend=backend)
  f = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                    check_vma=False)
  out = jax.jit(f)(x)
  return np.asarray(out.addressable_shards[0].data)[:, 0].tolist()


def _autotune(jax, pl, rank):
  """Each process's cache file names another winner; process 0's wins."""
  import hashlib
  import jax.numpy as jnp
  from dsl.tools import autotune_cache

  @pl.autotune(configs=[{"block": 256}, {"block": 512}, {"block": 1024}],
               key=["x"], name="multiprocess_add")
  def add(x, y, *, block=1024):
    spec = pl.BlockSpec((block,), lambda i: (i,))

    def kernel(x_ref, y_ref, o_ref):
      o_ref[...] = x_ref[...] + y_ref[...]
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(x.shape[0] // block,), in_specs=[spec, spec],
                          out_specs=spec, backend="interpret")(x, y)

  x = jnp.ones(4096, jnp.float32)
  autotune_cache.store(add.name, add.key_of((x, x), {}), add.backend_of({}),
                       {"block": (512, 1024)[rank]}, median_s=1e-3,
                       candidates=3)
  text = jax.jit(lambda a: add(a, a)).lower(x).as_text()
  choice = add.choose(x, x)
  return {"config": choice.config, "source": choice.source,
          "program": hashlib.sha1(text.encode()).hexdigest()}


def _failure(jax, mesh, pl, rank):
  """A check that fails on process 1's shard only: both processes raise."""
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))

  def positive(x_ref, o_ref):
    pl.debug_check(jnp.all(x_ref[...] >= 0), "x must not be negative")
    o_ref[...] = x_ref[...]
  f = pl.pallas_call(positive, jax.ShapeDtypeStruct((16, 128), jnp.float32),
                     grid=(2,), in_specs=[spec], out_specs=spec)
  local = np.full((8, 128), 1.0 - 2.0 * rank, np.float32)
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")),
                                             local)
  jax.config.update("jax_pallas_enable_runtime_assert", True)
  try:
    jax.block_until_ready(jax.jit(f)(x))
    return None
  except Exception as e:  # noqa: BLE001 - what each process saw
    err = pl.kernel_error_of(e)
    return f"{type(err or e).__name__}: {err or e}"
  finally:
    jax.config.update("jax_pallas_enable_runtime_assert", False)


def main(argv):
  rank, port, out_path, cache = int(argv[0]), argv[1], argv[2], argv[3]
  backends = argv[4].split(",")
  jax = _setup(rank, port, cache)
  import dsl as pl
  mesh = jax.make_mesh((2,), ("x",))
  call, shard_call = _kernels(pl)
  result = {"rank": rank, "devices": jax.device_count(),
            "processes": jax.process_count(), "backends": {}}
  for backend in backends:
    result["backends"][backend] = {
        **_partitioned(jax, mesh, call, backend, rank),
        "ring": _ring(jax, mesh, shard_call, backend, rank)}
  result["autotune"] = _autotune(jax, pl, rank)
  result["failure"] = _failure(jax, mesh, pl, rank)
  with open(out_path, "w") as fh:
    json.dump(result, fh)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1:])
