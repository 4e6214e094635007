"""Side-by-side CPU timings of each kernel against its jnp reference.

    python -m benchmarks.kernel_timing       # float32, forward and backward
    python -m benchmarks.kernel_timing --dtype bfloat16 --only flash_attention

Each case jits the kernel and its reference (and, for differentiable kernels,
`jax.grad` of `sum(out * cotangent)` through both: the "grad" columns time
forward plus backward), then times them in
interleaved rounds of calls queued back to back (`dsl.tools.timing`) and
reports the ratio kernel / reference of the medians (below 1 = the kernel is
faster). The forward figures for the common kernels
also come out of the benchmark CLI (`python -m benchmarks --kernels
kernels.softmax,...`); this script adds the backward passes and the decode
kernels.
"""
from __future__ import annotations

import argparse
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import kernels
from dsl.tools.timing import prepare, run_interleaved

REF = kernels.REFERENCES


def _normal(rng, shape, dtype, scale=1.0):
  return jnp.asarray(rng.standard_normal(shape, np.float32) * scale).astype(
      dtype)


def _cases(dtype):
  """(name, size, kernel fn, reference fn, inputs, differentiable argnums)."""
  r = np.random.default_rng(0)
  n = functools.partial(_normal, r, dtype=dtype)
  out = []

  x = n((4096, 1024))
  out.append(("softmax", "4096x1024", kernels.softmax,
              REF["softmax"], (x,), (0,)))
  x = n((1000, 3000))
  out.append(("softmax", "1000x3000", kernels.softmax,
              REF["softmax"], (x,), (0,)))
  x, w, b = n((4096, 1024)), n((1024,)), n((1024,))
  out.append(("layer_norm", "4096x1024", kernels.layer_norm,
              REF["layer_norm"], (x, w, b), (0, 1, 2)))
  out.append(("rms_norm", "4096x1024", kernels.rms_norm, REF["rms_norm"],
              (x, w), (0, 1)))
  x, y = n((1024, 1024)), n((1024, 1024), scale=1 / 32)
  out.append(("matmul", "1024x1024x1024", kernels.matmul,
              REF["matmul"], (x, y), (0, 1)))
  x, y, b = n((2048, 512)), n((512, 2048), scale=1 / 22), n((2048,))
  mm = lambda x, y, b: kernels.matmul(x, y, bias=b, activation="gelu")
  mm_ref = lambda x, y, b: REF["matmul"](x, y, bias=b, activation="gelu")
  out.append(("matmul+bias+gelu", "2048x512x2048", mm, mm_ref, (x, y, b),
               (0, 1, 2)))
  for causal in (False, True):
    q, k, v = n((2, 1024, 8, 64)), n((2, 1024, 8, 64)), n((2, 1024, 8, 64))
    fa = functools.partial(kernels.flash_attention, causal=causal)
    ref = functools.partial(REF["flash_attention"], causal=causal)
    out.append((f"flash_attention{' causal' if causal else ''}",
                "2x1024x8x64", fa, ref, (q, k, v), (0, 1, 2)))
  q, k, v = n((4, 512, 8, 64)), n((4, 512, 2, 64)), n((4, 512, 2, 64))
  fa = functools.partial(kernels.flash_attention, causal=True)
  ref = functools.partial(REF["flash_attention"], causal=True)
  out.append(("flash_attention gqa causal", "4x512x8(kv 2)x64", fa, ref,
              (q, k, v), (0, 1, 2)))
  b_, s, h, hkv, d = 8, 2048, 16, 4, 64
  q, kc, vc = n((b_, h, d)), n((b_, s, hkv, d)), n((b_, s, hkv, d))
  lens = jnp.asarray(r.integers(1, s + 1, (b_,)), jnp.int32)
  out.append(("decode_attention", "8x16(kv 4)x64, cache 2048",
              kernels.decode_attention, REF["decode_attention"],
              (q, kc, vc, lens), ()))
  page = 64
  pps = s // page
  kp = kc.transpose(2, 0, 1, 3).reshape(hkv, b_ * pps, page, d)
  vp = vc.transpose(2, 0, 1, 3).reshape(hkv, b_ * pps, page, d)
  perm = r.permutation(b_ * pps).astype(np.int32)
  inv = np.argsort(perm)
  kp, vp = kp[:, perm], vp[:, perm]
  table = jnp.asarray(inv.reshape(b_, pps), jnp.int32)
  out.append(("paged_attention", "8x16(kv 4)x64, 32 pages of 64",
              kernels.paged_attention, REF["paged_attention"],
              (q, kp, vp, lens, table), ()))
  return out


def _time(fns, args, rounds: int, inner: int):
  """Median seconds per call of each fn, timed in interleaved rounds of
  `inner` calls queued back to back."""
  prepared = {i: prepare(f, args, slow_s=math.inf, min_number=inner,
                         max_number=inner, keep_output=False, queued=True)
              for i, f in enumerate(fns)}
  stats = run_interleaved(prepared, args, repeats=rounds)
  return [stats[i].median for i in range(len(fns))]


def _grad_fn(fn, argnums, args):
  out = jax.eval_shape(fn, *args)
  ct = jnp.asarray(np.random.default_rng(1).standard_normal(
      out.shape, np.float32)).astype(out.dtype)

  def loss(*a):
    return jnp.sum(fn(*a).astype(jnp.float32) * ct.astype(jnp.float32))

  return jax.jit(jax.grad(loss, argnums=argnums))


def main(argv=None):
  p = argparse.ArgumentParser(description="kernels vs jnp references on CPU")
  p.add_argument("--dtype", default="float32",
                 choices=["float32", "bfloat16"])
  p.add_argument("--only", default=None,
                 help="comma-separated name prefixes, e.g. softmax,matmul")
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--inner", type=int, default=3)
  args = p.parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  only = args.only.split(",") if args.only else None
  print(f"{jax.devices()[0].device_kind} ({jax.default_backend()}), jax "
        f"{jax.__version__}, {args.dtype}; medians of {args.rounds} rounds "
        f"of {args.inner} calls; ratio = kernel / jnp reference under jit")
  print(f"{'kernel':28s} {'size':32s} {'fwd ms':>8s} {'ref ms':>8s} "
        f"{'ratio':>6s}   {'grad ms':>8s} {'ref ms':>8s} {'ratio':>6s}")
  worst = 0.0
  for name, size, fn, ref, inputs, argnums in _cases(dtype):
    if only and not any(name.startswith(o) for o in only):
      continue
    tk, tr = _time([jax.jit(fn), jax.jit(ref)], inputs, args.rounds,
                   args.inner)
    line = (f"{name:28s} {size:32s} {tk * 1e3:8.2f} {tr * 1e3:8.2f} "
            f"{tk / tr:6.2f}")
    worst = max(worst, tk / tr)
    if argnums:
      gk, gr = _time([_grad_fn(fn, argnums, inputs),
                      _grad_fn(ref, argnums, inputs)], inputs, args.rounds,
                     args.inner)
      line += f"   {gk * 1e3:8.2f} {gr * 1e3:8.2f} {gk / gr:6.2f}"
      worst = max(worst, gk / gr)
    print(line, flush=True)
  print(f"worst ratio: {worst:.2f}")


if __name__ == "__main__":
  main()
