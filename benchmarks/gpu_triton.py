"""GPU benchmark of the Triton backend (backend="triton"), side by side in one
run:

* bf16 matmul 4096^3: TFLOP/s of our generated kernel, of the same kernel
  source under jax.experimental.pallas (its Triton lowering), and of jnp.dot
  (cuBLAS);
* softmax and layer norm (bf16 rows): GB/s of ours and of Pallas, against the
  device's copy bandwidth measured in the same run.

The kernels are written once against a `pl` module (dsl or
jax.experimental.pallas) and run unchanged on both.

    python benchmarks/gpu_triton.py            # full sizes, prints a table
    python benchmarks/gpu_triton.py --quick    # small sizes (smoke test)
    python benchmarks/gpu_triton.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

if __package__ in (None, ""):     # run as a script: make the repo importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks import peak
from dsl.tools.timing import time_queued

# ------------------------------------------------------------------ kernels


def _compiler_params(pl, num_warps, num_stages):
  if pl.__name__ == "dsl":
    from dsl import triton as pl_triton
  else:
    from jax.experimental.pallas import triton as pl_triton
  return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _backend_kw(pl):
  return {"backend": "triton"} if pl.__name__ == "dsl" else {}


def make_matmul(pl, bm=128, bn=128, bk=64, num_warps=4, num_stages=3,
                out_dtype=None):
  """C = A @ B: a (bm, bn) tile per program, a fori_loop over K in bk steps
  accumulating in float32 registers."""
  def kernel(x_ref, y_ref, o_ref):
    k = x_ref.shape[1]

    def body(i, acc):
      x = x_ref[:, pl.ds(i * bk, bk)]
      y = y_ref[pl.ds(i * bk, bk), :]
      return acc + jnp.dot(x, y, preferred_element_type=jnp.float32)
    acc = lax.fori_loop(0, k // bk, body, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)

  def matmul(x, y):
    m, k = x.shape
    n = y.shape[1]
    return pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((m, n), out_dtype or x.dtype),
        grid=(m // bm, n // bn),
        in_specs=[pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((k, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=_compiler_params(pl, num_warps, num_stages),
        **_backend_kw(pl))(x, y)
  return matmul


def make_softmax(pl, block_rows=1, num_warps=4, num_stages=1):
  """Row softmax, one block of whole rows per program."""
  def kernel(x_ref, o_ref):
    x = x_ref[...].astype(jnp.float32)
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    o_ref[...] = (e / jnp.sum(e, axis=-1, keepdims=True)).astype(o_ref.dtype)

  def softmax(x):
    rows, cols = x.shape
    spec = pl.BlockSpec((block_rows, cols), lambda i: (i, 0))
    return pl.pallas_call(
        kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(rows, block_rows),), in_specs=[spec], out_specs=spec,
        compiler_params=_compiler_params(pl, num_warps, num_stages),
        **_backend_kw(pl))(x)
  return softmax


def make_layer_norm(pl, block_rows=1, eps=1e-5, num_warps=4, num_stages=1):
  """Row layer norm with a float32 weight and bias."""
  def kernel(x_ref, w_ref, b_ref, o_ref):
    x = x_ref[...].astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    xc = x - mean
    var = jnp.mean(xc * xc, axis=-1, keepdims=True)
    y = xc * lax.rsqrt(var + eps) * w_ref[...] + b_ref[...]
    o_ref[...] = y.astype(o_ref.dtype)

  def layer_norm(x, w, b):
    rows, cols = x.shape
    row_spec = pl.BlockSpec((block_rows, cols), lambda i: (i, 0))
    vec_spec = pl.BlockSpec((cols,), lambda i: (0,))
    return pl.pallas_call(
        kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(rows, block_rows),),
        in_specs=[row_spec, vec_spec, vec_spec], out_specs=row_spec,
        compiler_params=_compiler_params(pl, num_warps, num_stages),
        **_backend_kw(pl))(x, w, b)
  return layer_norm


def _layer_norm_reference(x, w, b, eps=1e-5):
  xf = x.astype(jnp.float32)
  mean = xf.mean(-1, keepdims=True)
  var = ((xf - mean) ** 2).mean(-1, keepdims=True)
  return ((xf - mean) * lax.rsqrt(var + eps) * w + b).astype(x.dtype)


def _max_error(got, want) -> float:
  return float(jnp.max(jnp.abs(got.astype(jnp.float32) -
                               want.astype(jnp.float32))))


# ------------------------------------------------------------------ runs

MATMUL_CONFIGS = [
    dict(bm=128, bn=128, bk=64, num_warps=4, num_stages=3),
    dict(bm=128, bn=256, bk=64, num_warps=8, num_stages=3),
    dict(bm=256, bn=128, bk=64, num_warps=8, num_stages=3),
    dict(bm=128, bn=128, bk=64, num_warps=4, num_stages=4),
    dict(bm=128, bn=256, bk=32, num_warps=8, num_stages=4),
]


def _peers():
  import dsl
  peers = {"ours": dsl}
  try:
    warnings.filterwarnings("ignore", message=".*Pallas Triton.*")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    import jax.experimental.pallas as jax_pallas
    peers["pallas"] = jax_pallas
  except Exception as e:   # noqa: BLE001 - report, keep going
    print(f"jax.experimental.pallas unavailable: {e}", file=sys.stderr)
  return peers


def bench_matmul(size: int, peers, rows: list) -> None:
  r = np.random.default_rng(0)
  x = jnp.asarray(r.standard_normal((size, size)), jnp.bfloat16)
  y = jnp.asarray(r.standard_normal((size, size)), jnp.bfloat16)
  flops = 2.0 * size ** 3
  want = jnp.dot(x, y, preferred_element_type=jnp.float32)
  ref = jax.jit(lambda x, y: jnp.dot(x, y))
  t_ref = time_queued(ref, x, y) * 1e3
  rows.append(dict(bench=f"matmul bf16 {size}^3", impl="jnp.dot (cuBLAS)",
                   config="", ms=t_ref, value=flops / t_ref / 1e9,
                   unit="TFLOP/s", err=_max_error(ref(x, y), want)))
  best = {}
  for cfg in MATMUL_CONFIGS:
    if size % cfg["bm"] or size % cfg["bn"] or size % cfg["bk"]:
      continue
    for name, pl in peers.items():
      label = "b{bm}x{bn}x{bk} w{num_warps} s{num_stages}".format(**cfg)
      ids = dict(kernel="matmul", size=f"{size}x{size}x{size}",
                 dtype="bfloat16", cfg=dict(variant="loop_k", **cfg))
      try:
        f = jax.jit(make_matmul(pl, **cfg))
        t = time_queued(f, x, y) * 1e3
        err = _max_error(f(x, y), want)
      except Exception as e:   # noqa: BLE001 - a failed peer is a table row
        rows.append(dict(bench=f"matmul bf16 {size}^3", impl=name,
                         config=label, ms=float("nan"), value=float("nan"),
                         unit="TFLOP/s", err=float("nan"),
                         note=f"{type(e).__name__}: {str(e)[:80]}", **ids))
        continue
      row = dict(bench=f"matmul bf16 {size}^3", impl=name, config=label,
                 ms=t, value=flops / t / 1e9, unit="TFLOP/s", err=err, **ids)
      rows.append(row)
      if name not in best or row["value"] > best[name]["value"]:
        best[name] = row
  ref_tflops = flops / t_ref / 1e9
  for name, row in best.items():
    row["note"] = f"best config; {row['value'] / ref_tflops:.2f}x jnp.dot"
    if "pallas" in best and name == "ours":
      row["note"] += (f", {row['value'] / best['pallas']['value']:.2f}x "
                      "Pallas")


def copy_bandwidth(shape) -> tuple[float, float]:
  """(ms, GB/s) of a bf16 copy of `shape` (read + write), as the CLI's peak."""
  nbytes = int(np.prod(shape)) * 2
  t = peak.time_copy(nbytes)
  return t * 1e3, peak.copy_rate(nbytes, t) / 1e9


def bench_rows(rows_n: int, cols: int, peers, rows: list) -> None:
  r = np.random.default_rng(1)
  x = jnp.asarray(r.standard_normal((rows_n, cols)), jnp.bfloat16)
  w = jnp.asarray(r.standard_normal(cols), jnp.float32)
  b = jnp.asarray(r.standard_normal(cols), jnp.float32)
  t_copy, copy_gbs = copy_bandwidth((rows_n, cols))
  rows.append(dict(bench=f"copy bf16 {rows_n}x{cols}", impl="XLA negate",
                   config="", ms=t_copy, value=copy_gbs, unit="GB/s", err=0.0,
                   note="measured device copy bandwidth (read + write)"))
  nbytes = 2 * x.size * x.dtype.itemsize
  cases = [
      ("softmax", lambda pl, nw: make_softmax(pl, num_warps=nw), (x,),
       jax.nn.softmax(x.astype(jnp.float32), -1)),
      ("layer norm", lambda pl, nw: make_layer_norm(pl, num_warps=nw),
       (x, w, b), _layer_norm_reference(x, w, b)),
  ]
  suite_name = {"softmax": "softmax", "layer norm": "layer_norm"}
  for bench, make, args, want in cases:
    ref = jax.jit({"softmax": lambda x: jax.nn.softmax(x, -1),
                   "layer norm": _layer_norm_reference}[bench])
    t = time_queued(ref, *args) * 1e3
    rows.append(dict(bench=f"{bench} bf16 {rows_n}x{cols}", impl="XLA (jnp)",
                     config="", ms=t, value=nbytes / t / 1e6, unit="GB/s",
                     err=_max_error(ref(*args), want),
                     note=f"{nbytes / t / 1e6 / copy_gbs:.0%} of copy"))
    for name, pl in peers.items():
     for nw in (4, 8, 16):     # the same launch configs for every peer
      ids = dict(kernel=suite_name[bench], size=f"{rows_n}x{cols}",
                 dtype="bfloat16",
                 cfg=dict(block_rows=1, num_warps=nw, num_stages=1))
      try:
        f = jax.jit(make(pl, nw))
        t = time_queued(f, *args) * 1e3
        err = _max_error(f(*args), want)
        gbs = nbytes / t / 1e6
        rows.append(dict(bench=f"{bench} bf16 {rows_n}x{cols}", impl=name,
                         config=f"1 row/program w{nw}", ms=t, value=gbs,
                         unit="GB/s", err=err,
                         note=f"{gbs / copy_gbs:.0%} of copy", **ids))
      except Exception as e:   # noqa: BLE001
        rows.append(dict(bench=f"{bench} bf16 {rows_n}x{cols}", impl=name,
                         config=f"1 row/program w{nw}", ms=float("nan"),
                         value=float("nan"), unit="GB/s", err=float("nan"),
                         note=f"{type(e).__name__}: {str(e)[:80]}", **ids))


def print_table(rows: list) -> None:
  headers = ["benchmark", "impl", "config", "ms", "value", "unit", "max err",
             "note"]
  table = [[r["bench"], r["impl"], r.get("config", ""), f"{r['ms']:.4f}",
            f"{r['value']:.1f}", r["unit"], f"{r['err']:.3g}",
            r.get("note", "")] for r in rows]
  widths = [max(len(h), *(len(row[i]) for row in table))
            for i, h in enumerate(headers)]
  line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
  print(line)
  print("-" * len(line))
  for row in table:
    print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="small sizes")
  parser.add_argument("--only", choices=["matmul", "rows"],
                      help="run one of the two benchmarks")
  parser.add_argument("--json", help="also write the rows to this file")
  parser.add_argument("--matmul-size", type=int, default=None)
  args = parser.parse_args(argv)
  devices = [d for d in jax.devices() if d.platform == "gpu"]
  if not devices:
    print("no GPU: this benchmark needs a CUDA device", file=sys.stderr)
    return 2
  import triton
  print(f"device: {devices[0].device_kind}   jax {jax.__version__}   "
        f"triton {triton.__version__}")
  size = args.matmul_size or (1024 if args.quick else 4096)
  rows_n, cols = (1024, 1024) if args.quick else (16384, 8192)
  peers = _peers()
  rows: list = []
  if args.only != "rows":
    bench_matmul(size, peers, rows)
  if args.only != "matmul":
    bench_rows(rows_n, cols, peers, rows)
  print_table(rows)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
