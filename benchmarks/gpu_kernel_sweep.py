"""Sweeps block sizes and num_warps of the kernel library on a GPU, to pick
the Triton defaults in kernels/ (a tuning aid; prints one line per config).

    python -m benchmarks.gpu_kernel_sweep
"""
from __future__ import annotations

import itertools
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import kernels
from benchmarks.gpu_attention import _time
import lowering_triton.kernel as tk


def main():
  if jax.default_backend() != "gpu":
    print("needs a GPU", file=sys.stderr)
    return 2
  x = jax.random.normal(jax.random.key(0), (16384, 8192), jnp.bfloat16)
  w = jnp.ones(8192, jnp.bfloat16)
  nbytes = 2 * x.size * 2
  copy = _time(jax.jit(lambda a: -a), x)
  print(f"copy {nbytes / copy / 1e9:.0f} GB/s")
  for nw in (4, 8, 16):
    tk.DEFAULT_NUM_WARPS = nw
    jax.clear_caches()
    cases = {
        "layer_norm br1": lambda x: kernels.layer_norm(x, w, w, backend="triton", block_rows=1),
        "layer_norm br2": lambda x: kernels.layer_norm(x, w, w, backend="triton", block_rows=2),
        "rms_norm br1": lambda x: kernels.rms_norm(x, w, backend="triton", block_rows=1),
        "softmax default": lambda x: kernels.softmax(x, backend="triton"),
        "softmax row": lambda x: kernels.softmax(x, backend="triton", block_rows=1, block_cols=8192),
    }
    for name, fn in cases.items():
      try:
        t = _time(jax.jit(fn), x)
        print(f"nw={nw:2d} {name:18s} {t * 1e3:.3f} ms {nbytes / t / 1e9:.0f} GB/s "
              f"{copy / t:.2f} of copy")
      except Exception as e:
        print(f"nw={nw:2d} {name:18s} failed: {type(e).__name__}: {str(e)[:100]}")
  b, s, h, d = 4, 2048, 16, 128
  ks = jax.random.split(jax.random.key(1), 3)
  q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in ks)
  flops = 4 * b * h * s * s * d
  for nw, stages in ((4, 2), (4, 3), (8, 2), (8, 3)):
    tk.DEFAULT_NUM_WARPS, tk.DEFAULT_NUM_STAGES = nw, stages
    jax.clear_caches()
    for bq, bk in ((64, 32), (64, 64), (128, 64), (128, 128), (64, 128)):
      fn = jax.jit(lambda q, k, v: kernels.flash_attention(
          q, k, v, backend="triton", block_q=bq, block_k=bk))
      try:
        t = _time(fn, q, k, v, repeats=10)
        print(f"flash fwd nw={nw} st={stages} bq={bq:3d} bk={bk:3d}: {t * 1e3:.3f} ms "
              f"{flops / t / 1e12:.0f} TFLOP/s")
      except Exception as e:
        print(f"flash fwd nw={nw} st={stages} bq={bq} bk={bk}: failed {type(e).__name__}: {str(e)[:100]}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
