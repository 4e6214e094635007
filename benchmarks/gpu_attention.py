"""GPU figures for the kernel library, side by side in one run.

Flash attention forward and forward+backward (bf16, batch 4, 16 heads,
head_dim 128, seq 2048 and 8192) against jax.experimental.pallas's GPU
attention and cuDNN (`jax.nn.dot_product_attention(implementation="cudnn")`);
softmax, layer norm and rms norm GB/s against the device's copy bandwidth.

    python -m benchmarks.gpu_attention [--seqs 2048,8192] [--json out.json]
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys

import jax
import jax.numpy as jnp

from benchmarks import peak
from dsl.tools.timing import time_queued


def copy_bandwidth(nbytes=peak.GPU_COPY_BYTES):
  """Bytes/s of a device-to-device copy (read + write), as the CLI's peak."""
  return peak.copy_rate(nbytes, peak.time_copy(nbytes))


def timed_or_reason(name, fn, *args):
  """(seconds, None) of `fn(*args)` timed queued, or (None, why it cannot
  run here)."""
  try:
    return time_queued(fn, *args), None
  except Exception as e:  # a peer that cannot run here is reported as such
    return None, f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:80]}"


def attention_rows(seqs, batch=4, heads=16, dim=128, causal=False,
                   backends=("triton",)):
  """Ours on each dsl backend (`ours_*` on Triton, `mosaic_gpu_*` on
  Mosaic GPU), Pallas's attention and cuDNN, per sequence length."""
  import kernels
  from jax.experimental.pallas.ops.gpu import attention as pallas_attention
  rows = []
  for s in seqs:
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (batch, s, heads, dim), jnp.bfloat16)
               for kk in ks)
    scale = 1.0 / math.sqrt(dim)
    mine = {b: jax.jit(functools.partial(
        kernels.flash_attention, causal=causal, sm_scale=scale, backend=b))
        for b in backends}
    peer = jax.jit(lambda q, k, v: pallas_attention.mha(
        q, k, v, None, sm_scale=scale, causal=causal))
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=causal, implementation="cudnn"))
    loss = lambda f: jax.jit(jax.grad(lambda q, k, v: jnp.sum(
        f(q, k, v).astype(jnp.float32)), (0, 1, 2)))
    flops = 4 * batch * heads * s * s * dim * (0.5 if causal else 1.0)
    for mode, wrap, mult in (("fwd", lambda f: f, 1.0),
                             ("fwd+bwd", loss, 3.5)):
      t_peer, perr = timed_or_reason("pallas", wrap(peer), q, k, v)
      t_cudnn, cerr = timed_or_reason("cudnn", wrap(cudnn), q, k, v)
      row = {"kernel": "flash_attention", "mode": mode, "seq": s,
             "pallas_ms": t_peer and t_peer * 1e3, "pallas_note": perr,
             "cudnn_ms": t_cudnn and t_cudnn * 1e3, "cudnn_note": cerr}
      for b, fn in mine.items():
        t, err = timed_or_reason(b, wrap(fn), q, k, v)
        pre = "" if b == "triton" else f"{b}_"
        row.update({
            f"{pre}ours_ms": t and t * 1e3, f"{pre}error": err,
            f"{pre}tflops": t and flops * mult / t / 1e12,
            f"{pre}vs_pallas": (t_peer / t) if t and t_peer else None,
            f"{pre}vs_cudnn": (t_cudnn / t) if t and t_cudnn else None})
      rows.append(row)
  return rows


def rowwise_rows(bw, shape=(8192, 8192)):
  import kernels
  x = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)
  w = jnp.ones(shape[-1], jnp.bfloat16)
  b = jnp.zeros(shape[-1], jnp.bfloat16)
  cases = {
      "softmax": lambda x: kernels.softmax(x, backend="triton"),
      "layer_norm": lambda x: kernels.layer_norm(x, w, b, backend="triton"),
      "rms_norm": lambda x: kernels.rms_norm(x, w, backend="triton"),
  }
  # The copy of an array of the same size is the fair peak for a row kernel
  # (a 1 GiB copy runs faster than any 128 MiB kernel can).
  same_size_copy = copy_bandwidth(x.size * x.dtype.itemsize)
  rows = []
  for name, fn in cases.items():
    t, err = timed_or_reason(name, jax.jit(fn), x)
    gbs = t and 2 * x.size * x.dtype.itemsize / t
    rows.append({"kernel": name, "shape": shape, "ms": t and t * 1e3,
                 "GB/s": gbs and gbs / 1e9,
                 "fraction_of_copy": gbs and gbs / bw,
                 "same_size_copy_GBps": same_size_copy / 1e9,
                 "fraction_of_same_size_copy": gbs and gbs / same_size_copy,
                 "error": err})
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seqs", default="2048,8192")
  p.add_argument("--json")
  p.add_argument("--only", choices=["attention", "rowwise"])
  p.add_argument("--backends", default="triton", help="dsl backends of the "
                 "attention rows, e.g. triton,mosaic_gpu (default triton)")
  a = p.parse_args(argv)
  if jax.default_backend() != "gpu":
    print("gpu_attention: needs a GPU (jax.default_backend() is "
          f"{jax.default_backend()!r})", file=sys.stderr)
    return 2
  bw = copy_bandwidth()
  print(f"device: {jax.devices()[0].device_kind}; copy bandwidth "
        f"{bw / 1e9:.0f} GB/s")
  backends = [b.strip() for b in a.backends.split(",") if b.strip()]
  att = ([] if a.only == "rowwise"
         else attention_rows([int(s) for s in a.seqs.split(",")],
                             backends=backends))
  for r in att:
    for b in backends:
      pre = "" if b == "triton" else f"{b}_"
      print(f"flash_attention {r['mode']:8s} seq={r['seq']:5d} {b}: ours "
            f"{_fmt(r[pre + 'ours_ms'])} ms ({_fmt(r[pre + 'tflops'])} "
            f"TFLOP/s) | pallas {_fmt(r['pallas_ms'])} ms -> "
            f"{_fmt(r[pre + 'vs_pallas'])}x | cudnn {_fmt(r['cudnn_ms'])} ms "
            f"-> {_fmt(r[pre + 'vs_cudnn'])}x {r[pre + 'error'] or ''} "
            f"{r['pallas_note'] or ''} {r['cudnn_note'] or ''}")
  rw = [] if a.only == "attention" else (rowwise_rows(bw) + rowwise_rows(
      bw, (16384, 8192)))
  for r in rw:
    print(f"{r['kernel']:10s} {r['shape']}: {_fmt(r['ms'])} ms, "
          f"{_fmt(r['GB/s'])} GB/s = {_fmt(r['fraction_of_copy'])} of the "
          f"1 GiB copy, {_fmt(r['fraction_of_same_size_copy'])} of a "
          f"same-size copy ({_fmt(r['same_size_copy_GBps'])} GB/s) "
          f"{r['error'] or ''}")
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"copy_GBps": bw / 1e9, "attention": att, "rowwise": rw}, f,
                indent=1)
  return 0


def _fmt(v):
  return "n/a" if v is None else f"{v:.3g}"


if __name__ == "__main__":
  sys.exit(main())
