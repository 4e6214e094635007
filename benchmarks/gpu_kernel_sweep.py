"""Sweeps tiles, num_warps and num_stages of the kernel library on a GPU, to
pick the Triton defaults in kernels/ (a tuning aid; one line per config).

    python -m benchmarks.gpu_kernel_sweep [--only rows,fwd,bwd] [--seq 2048]
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

import kernels
import lowering_triton.launch_config as tk
from dsl.tools import gpu_defaults
from dsl.tools.timing import time_queued
from kernels.flash_attention import TRITON_CONFIGS

TILES = ((64, 32), (64, 64), (128, 32), (128, 64), (64, 128), (128, 128))
# (backward: the larger of the two is the block each kernel keeps)
LAUNCH = ((4, 2), (4, 3), (8, 2), (8, 3))


def rows():
  x = jax.random.normal(jax.random.key(0), (16384, 8192), jnp.bfloat16)
  w = jnp.ones(8192, jnp.bfloat16)
  nbytes = 2 * x.size * 2
  copy = time_queued(jax.jit(lambda a: -a), x)
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
      _report(f"nw={nw:2d} {name:18s}", lambda: time_queued(jax.jit(fn), x),
              lambda t: f"{nbytes / t / 1e9:.0f} GB/s {copy / t:.2f} of copy")


def _qkv(seq, b=4, h=16, d=128):
  ks = jax.random.split(jax.random.key(1), 3)
  return [jax.random.normal(kk, (b, seq, h, d), jnp.bfloat16) for kk in ks]


def attention(mode, seq):
  """Forward tiles/launch (mode "fwd") or backward ones (mode "bwd", timing
  forward + backward with the forward at its defaults)."""
  q, k, v = _qkv(seq)
  b, s, h, d = q.shape
  flops = 4 * b * h * s * s * d * (1.0 if mode == "fwd" else 3.5)
  saved = dict(TRITON_CONFIGS)
  f = lambda q, k, v: kernels.flash_attention(q, k, v, backend="triton")
  if mode == "bwd":
    f = jax.grad(lambda q, k, v: jnp.sum(
        kernels.flash_attention(q, k, v, backend="triton").astype(
            jnp.float32)), (0, 1, 2))
  try:
    for tiles in TILES:
      for nw, st in LAUNCH:
        if mode == "fwd":
          TRITON_CONFIGS["fwd"] = (*tiles, nw, st)
        else:     # dK/dV keeps the larger block of kv rows, dQ of q rows
          small, big = sorted(tiles)
          TRITON_CONFIGS["dkdv"] = (small, big, nw, st)
          TRITON_CONFIGS["dq"] = (big, small, nw, st)
        jax.clear_caches()
        _report(f"flash {mode} seq={seq} tiles={tiles} nw={nw} st={st}",
                lambda: time_queued(jax.jit(f), q, k, v),
                lambda t: f"{flops / t / 1e12:.0f} TFLOP/s")
  finally:
    TRITON_CONFIGS.update(saved)


def _report(label, timed, extra):
  try:
    t = timed()
    print(f"{label}: {t * 1e3:.3f} ms {extra(t)}", flush=True)
  except Exception as e:  # a config that does not compile (shared memory)
    print(f"{label}: failed {type(e).__name__}: {str(e)[:100]}", flush=True)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--only", default="rows,fwd,bwd")
  p.add_argument("--seq", type=int, default=2048)
  a = p.parse_args(argv)
  # The sweep patches the code's tables; the shipped defaults would win.
  os.environ[gpu_defaults.ENV_SWITCH] = "0"
  if jax.default_backend() != "gpu":
    print("needs a GPU", file=sys.stderr)
    return 2
  parts = a.only.split(",")
  if "rows" in parts:
    rows()
  for mode in ("fwd", "bwd"):
    if mode in parts:
      attention(mode, a.seq)
  return 0


if __name__ == "__main__":
  sys.exit(main())
