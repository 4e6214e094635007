"""Elementwise add over a 1-D grid of blocks (memory bound)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.suite.base import (KernelBench, pow2_at_most, random_inputs,
                                   unique_configs)


def add_kernel(x_ref, y_ref, o_ref):
  o_ref[...] = x_ref[...] + y_ref[...]


class Add(KernelBench):
  name = "add"
  summary = "o = x + y, 1-D blocks (interpret-speed case: 4M on a 4096-point grid)"
  dims_doc = "N elements"

  def normalize(self, dims):
    self.check_dims(dims, (1,))
    return tuple(dims)

  def default_sizes(self, platform):
    if platform == "gpu":
      return [(1 << 22,), (1 << 26,)]
    return [(1 << 20,), (1 << 22,)]

  def quick_sizes(self, platform):
    return [(1 << 22,)] if platform != "gpu" else [(1 << 22,), (1 << 26,)]

  def inputs(self, size, dtype):
    return random_inputs([size, size], dtype)

  def reference(self, x, y):
    return x + y

  def default_config(self, size, backend, platform):
    config = {"block": 1024}
    if backend == "triton":
      config.update(num_warps=4, num_stages=1)
    return self.fix_config(size, config)

  def search_space(self, size, backend, platform):
    blocks = [256, 1024, 4096, 16384, 65536]
    warps = [2, 4, 8] if backend == "triton" else [None]
    out = []
    for b in blocks:
      if b > size[0] and b != blocks[0]:
        continue
      for w in warps:
        c = {"block": b}
        if w is not None:
          c.update(num_warps=w, num_stages=1)
        out.append(self.fix_config(size, c))
    return unique_configs(out)

  def fix_config(self, size, config, dtype=None):
    c = dict(config)
    c["block"] = min(int(c.get("block", 1024)), pow2_at_most(size[0]))
    return c

  def build(self, pl, size, dtype, config, **call_kw):
    n, block = size[0], config["block"]
    spec = pl.BlockSpec((block,), lambda i: (i,))
    return pl.pallas_call(
        add_kernel, jax.ShapeDtypeStruct((n,), dtype),
        grid=(pl.cdiv(n, block),), in_specs=[spec, spec], out_specs=spec,
        name="bench_add", **call_kw)

  def grid_points(self, size, config):
    return -(-size[0] // config["block"])

  def flops(self, size):
    return float(size[0])

  def io_bytes(self, size, dtype):
    return 3.0 * size[0] * jnp.dtype(dtype).itemsize

  def tolerance(self, dtype):
    return 1e-6 if jnp.dtype(dtype).itemsize >= 4 else 1e-2

  def triton_peer(self, size, dtype, config):
    from benchmarks import triton_peers
    return triton_peers.add(size, dtype, config)

