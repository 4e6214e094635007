"""Row-wise kernels (softmax, layer_norm): each grid point owns a block of
whole rows, so the reduction stays inside the kernel."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.suite.base import (KernelBench, pow2_at_most, random_inputs,
                                   unique_configs)

LN_EPS = 1e-5


def softmax_kernel(x_ref, o_ref):
  x = x_ref[...].astype(jnp.float32)
  e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
  o_ref[...] = (e / jnp.sum(e, axis=-1, keepdims=True)).astype(o_ref.dtype)


def layer_norm_kernel(x_ref, w_ref, b_ref, o_ref):
  x = x_ref[...].astype(jnp.float32)
  mean = jnp.mean(x, axis=-1, keepdims=True)
  xc = x - mean
  var = jnp.mean(xc * xc, axis=-1, keepdims=True)
  y = xc * jax.lax.rsqrt(var + LN_EPS)
  w = w_ref[...].astype(jnp.float32)
  b = b_ref[...].astype(jnp.float32)
  o_ref[...] = (y * w + b).astype(o_ref.dtype)


class RowWise(KernelBench):
  dims_doc = "ROWSxCOLS"
  n_params = 0      # per-column parameter vectors (layer_norm: weight, bias)
  body = None

  def normalize(self, dims):
    self.check_dims(dims, (2,))
    return tuple(dims)

  def default_sizes(self, platform):
    if platform == "gpu":
      return [(4096, 1024), (16384, 4096)]
    return [(1024, 1024), (4096, 1024)]

  def quick_sizes(self, platform):
    return self.default_sizes(platform)[-1:] if platform != "gpu" else \
        self.default_sizes(platform)

  def inputs(self, size, dtype):
    rows, cols = size
    return random_inputs([size] + [(cols,)] * self.n_params, dtype)

  def default_config(self, size, backend, platform):
    if backend == "triton":
      c = {"block_rows": 1, "num_warps": 4 if size[1] <= 2048 else 8,
           "num_stages": 1}
    else:
      c = {"block_rows": 64}
    return self.fix_config(size, c)

  def search_space(self, size, backend, platform):
    if backend == "triton":
      space = [{"block_rows": r, "num_warps": w, "num_stages": 1}
               for r in (1, 2, 4) for w in (2, 4, 8, 16)]
    else:
      space = [{"block_rows": r} for r in (8, 32, 128, 512)]
    return unique_configs([self.fix_config(size, c) for c in space])

  def fix_config(self, size, config, dtype=None):
    c = dict(config)
    c["block_rows"] = min(int(c.get("block_rows", 64)), pow2_at_most(size[0]))
    return c

  def build(self, pl, size, dtype, config, **call_kw):
    rows, cols = size
    br = config["block_rows"]
    row_spec = pl.BlockSpec((br, cols), lambda i: (i, 0))
    param_spec = pl.BlockSpec((cols,), lambda i: (0,))
    return pl.pallas_call(
        type(self).body, jax.ShapeDtypeStruct(size, dtype),
        grid=(pl.cdiv(rows, br),),
        in_specs=[row_spec] + [param_spec] * self.n_params,
        out_specs=row_spec, name=f"bench_{self.name}", **call_kw)

  def grid_points(self, size, config):
    return -(-size[0] // config["block_rows"])

  def io_bytes(self, size, dtype):
    rows, cols = size
    return float(2 * rows * cols + self.n_params * cols) * jnp.dtype(
        dtype).itemsize


class Softmax(RowWise):
  name = "softmax"
  summary = "row softmax, blocks of whole rows"
  body = staticmethod(softmax_kernel)

  def reference(self, x):
    return jax.nn.softmax(x, axis=-1)

  def flops(self, size):
    return 5.0 * size[0] * size[1]

  def triton_peer(self, size, dtype, config):
    from benchmarks import triton_peers
    return triton_peers.softmax(size, dtype, config)


class LayerNorm(RowWise):
  name = "layer_norm"
  summary = "layer norm over the last dim with weight and bias"
  n_params = 2
  body = staticmethod(layer_norm_kernel)

  def reference(self, x, w, b):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.var(xf, axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + LN_EPS) * w + b
    return y.astype(x.dtype)

  def flops(self, size):
    return 8.0 * size[0] * size[1]
