"""Blocked matmul, two ways: a 3-D grid whose k axis revisits the output
block (the interpret-speed case: 1024^3 f32 on 128-blocks), or a 2-D grid with
the k loop inside the kernel (the form Triton needs)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from benchmarks.usage_errors import UsageError
from benchmarks.suite.base import (KernelBench, pow2_at_most, random_inputs,
                                   unique_configs)

VARIANTS = ("grid_k", "loop_k")
# Triton tiles (bm, bn) searched by --autotune: the measured winners on Hopper
# (128x256 bf16, 32x128 f32; dsl/tools/data/gpu_configs.json) and their neighbours.
TRITON_TILES = ((32, 128), (64, 64), (64, 128), (128, 64), (128, 128),
                (128, 256), (256, 128))
TRITON_LAUNCH = ((4, 3), (4, 4), (8, 3))     # (num_warps, num_stages)


@functools.lru_cache(maxsize=None)
def grid_k_kernel(pl):
  def matmul_grid_k(x_ref, y_ref, o_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += jnp.dot(x_ref[...], y_ref[...],
                          preferred_element_type=jnp.float32).astype(o_ref.dtype)
  return matmul_grid_k


@functools.lru_cache(maxsize=None)
def loop_k_kernel(pl, bk: int, nk: int):
  def matmul_loop_k(x_ref, y_ref, o_ref):
    def body(k, acc):
      start = pl.multiple_of(k * bk, bk)
      x = x_ref[:, pl.ds(start, bk)]
      y = y_ref[pl.ds(start, bk), :]
      return acc + jnp.dot(x, y, preferred_element_type=jnp.float32)
    acc = jax.lax.fori_loop(0, nk, body,
                            jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)
  return matmul_loop_k


class Matmul(KernelBench):
  name = "matmul"
  summary = ("o = x @ y, blocked (interpret-speed case: 1024^3 f32, "
             "128x128x128 blocks)")
  dims_doc = "M (square) or MxKxN"
  bound = "compute"

  def normalize(self, dims):
    self.check_dims(dims, (1, 3))
    return tuple(dims) * 3 if len(dims) == 1 else tuple(dims)

  def default_sizes(self, platform):
    if platform == "gpu":
      return [(1024,) * 3, (4096,) * 3]
    return [(256,) * 3, (512,) * 3, (1024,) * 3]

  def quick_sizes(self, platform):
    return [(1024,) * 3] if platform != "gpu" else [(1024,) * 3, (4096,) * 3]

  def inputs(self, size, dtype):
    m, k, n = size
    return random_inputs([(m, k), (k, n)], dtype)

  def reference(self, x, y):
    if x.dtype == jnp.float32:
      return jnp.dot(x, y)
    return jnp.dot(x, y, preferred_element_type=jnp.float32).astype(x.dtype)

  def default_config(self, size, backend, platform):
    """The code's default; on GPUs the shipped table's entry for the device
    goes over it (`chosen_config`)."""
    if backend == "triton":
      c = {"variant": "loop_k", "bm": 64, "bn": 64, "bk": 32,
           "num_warps": 4, "num_stages": 3}
    else:
      c = {"variant": "grid_k", "bm": 128, "bn": 128, "bk": 128}
    return self.fix_config(size, c)

  def search_space(self, size, backend, platform):
    out = []
    if backend == "triton":
      for bm, bn in TRITON_TILES:
        for bk in (32, 64):
          for w, s in TRITON_LAUNCH:
            out.append({"variant": "loop_k", "bm": bm, "bn": bn, "bk": bk,
                        "num_warps": w, "num_stages": s})
    else:
      for variant in VARIANTS:
        for b in (64, 128, 256):
          for bk in (128, 256, 512):
            out.append({"variant": variant, "bm": b, "bn": b, "bk": bk})
    return unique_configs([self.fix_config(size, c) for c in out])

  def fix_config(self, size, config, dtype=None):
    m, k, n = size
    c = {"variant": config.get("variant", "grid_k")}
    c.update((key, v) for key, v in config.items() if key != "variant")
    if c["variant"] not in VARIANTS:
      raise UsageError(f"matmul variant {c['variant']!r}: choose one of "
                       f"{', '.join(VARIANTS)}")
    if dtype is not None and c["variant"] == "grid_k" and jnp.dtype(
        dtype).itemsize < 4:
      c["variant"] = "loop_k"   # accumulating in a half-precision output loses bits
    c["bm"] = min(int(c.get("bm", 128)), pow2_at_most(m))
    c["bn"] = min(int(c.get("bn", 128)), pow2_at_most(n))
    bk = min(int(c.get("bk", 128)), k)
    c["bk"] = bk if k % bk == 0 else k   # partial k blocks would add padding
    return c

  def build(self, pl, size, dtype, config, **call_kw):
    m, k, n = size
    bm, bn, bk = config["bm"], config["bn"], config["bk"]
    out_shape = jax.ShapeDtypeStruct((m, n), dtype)
    if config["variant"] == "grid_k":
      return pl.pallas_call(
          grid_k_kernel(pl), out_shape,
          grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), k // bk),
          in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                    pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
          out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
          name="bench_matmul", **call_kw)
    return pl.pallas_call(
        loop_k_kernel(pl, bk, k // bk), out_shape,
        grid=(pl.cdiv(m, bm), pl.cdiv(n, bn)),
        in_specs=[pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((k, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        name="bench_matmul", **call_kw)

  def grid_points(self, size, config):
    m, k, n = size
    g = -(-m // config["bm"]) * -(-n // config["bn"])
    return g * (k // config["bk"]) if config["variant"] == "grid_k" else g

  def flops(self, size):
    m, k, n = size
    return 2.0 * m * k * n

  def io_bytes(self, size, dtype):
    m, k, n = size
    return float(m * k + k * n + m * n) * jnp.dtype(dtype).itemsize

  def tolerance(self, dtype):
    # relative to max |x @ y|; f32 dots on GPUs may use TF32
    return 1e-2 if jnp.dtype(dtype).itemsize >= 4 else 5e-2

  def triton_peer(self, size, dtype, config):
    from benchmarks import triton_peers
    return triton_peers.matmul(size, dtype, config)
