"""Kernels from the `kernels/` library, picked up when importable.

Contract looked for (see docs/benchmarks.md): `kernels.<name>(*inputs,
backend=...)` runs the kernel; its pure-jnp reference is the first found of
`kernels.<name>.reference`, `kernels.<name>_reference`, `kernels.<name>_ref`,
`kernels.reference(s).<name>`, `kernels.<name>` module's `reference`. A kernel
may carry `bench_inputs(size, dtype)` to build its own inputs. Anything
missing makes the kernel show as unavailable in `--list`; nothing fails.
"""
from __future__ import annotations

import importlib
import inspect
import math
import types

import jax
import jax.numpy as jnp

from benchmarks.suite.base import KernelBench, random_inputs
from benchmarks.suite.rowwise import LN_EPS
from dsl.core import backends
from dsl.tools import gpu_defaults

NAMES = ("softmax", "layer_norm", "rms_norm", "matmul", "flash_attention")


def _import(name):
  try:
    return importlib.import_module(name), None
  except Exception as e:  # a half-built package must not break benchmarks
    return None, f"{type(e).__name__}: {e}".splitlines()[0]


def _resolve_function(pkg, name):
  """`kernels.softmax` may be the function or a module holding it."""
  obj = getattr(pkg, name, None)
  if obj is None:
    obj, _ = _import(f"kernels.{name}")
  if isinstance(obj, types.ModuleType):
    module = obj
    obj = getattr(module, name, None)
    return obj, module
  return obj, None


def _resolve_reference(pkg, name, fn, module):
  refs = getattr(pkg, "REFERENCES", None)
  candidates = [refs.get(name) if isinstance(refs, dict) else None,
                getattr(fn, "reference", None)]
  if module is not None:
    candidates += [getattr(module, "reference", None),
                   getattr(module, f"{name}_reference", None)]
  candidates += [getattr(pkg, f"{name}_reference", None),
                 getattr(pkg, f"{name}_ref", None)]
  for sub in ("reference", "references"):
    m = getattr(pkg, sub, None)
    if not isinstance(m, types.ModuleType):
      m, _ = _import(f"kernels.{sub}")
    if m is not None:
      candidates.append(getattr(m, name, None))
  for c in candidates:
    if callable(c) and not isinstance(c, types.ModuleType):
      return c
  return None


def _takes_backend(fn) -> bool:
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    return True
  return any(p.name == "backend" or p.kind is p.VAR_KEYWORD for p in params)


# Our own references, used only when kernels/ provides none.
def _softmax_ref(x):
  return jax.nn.softmax(x, axis=-1)


def _layer_norm_ref(x, w, b):
  xf = x.astype(jnp.float32)
  y = (xf - xf.mean(-1, keepdims=True)) * jax.lax.rsqrt(
      xf.var(-1, keepdims=True) + LN_EPS) * w + b
  return y.astype(x.dtype)


def _rms_norm_ref(x, w):
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6) * w
  return y.astype(x.dtype)


def _matmul_ref(x, y):
  return jnp.dot(x, y, preferred_element_type=jnp.float32).astype(x.dtype)


def _attention_ref(q, k, v):
  # (batch, seq, heads, head_dim), like Pallas's ops.gpu.attention.mha.
  s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32))
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32)).astype(q.dtype)


# name -> dims doc, allowed ranks, sizes (cpu, gpu), input shapes, flops, ref
_SHAPES = {
    "softmax": ("ROWSxCOLS", (2,), [(4096, 1024)], [(4096, 1024), (16384, 4096)],
                lambda s: [s], lambda s: 5.0 * s[0] * s[1], _softmax_ref,
                "memory"),
    "layer_norm": ("ROWSxCOLS", (2,), [(4096, 1024)],
                   [(4096, 1024), (16384, 4096)],
                   lambda s: [s, (s[1],), (s[1],)],
                   lambda s: 8.0 * s[0] * s[1], _layer_norm_ref, "memory"),
    "rms_norm": ("ROWSxCOLS", (2,), [(4096, 1024)],
                 [(4096, 1024), (16384, 4096)], lambda s: [s, (s[1],)],
                 lambda s: 4.0 * s[0] * s[1], _rms_norm_ref, "memory"),
    "matmul": ("M (square) or MxKxN", (1, 3), [(1024, 1024, 1024)],
               [(1024,) * 3, (4096,) * 3],
               lambda s: [(s[0], s[1]), (s[1], s[2])],
               lambda s: 2.0 * s[0] * s[1] * s[2], _matmul_ref, "compute"),
    "flash_attention": ("BATCHxSEQxHEADSxHEAD_DIM", (4,), [(1, 512, 4, 64)],
                        [(4, 2048, 16, 64)],
                        lambda s: [s, s, s],
                        lambda s: 4.0 * s[0] * s[1] * s[1] * s[2] * s[3],
                        _attention_ref, "compute"),
}


def _triton(backend) -> bool:
  """Whether `backend` builds Triton kernels (one GPU program per block)."""
  return backends.REGISTRY[backend].code == "triton"


def _rows_space(size, backend):
  rows = size[0]
  opts = (1, 2, 4, 8) if _triton(backend) else (16, 64, 256, 1024)
  return [{"block_rows": r} for r in opts if r <= rows]


def _matmul_space(size, backend):
  m, k, n = size
  if _triton(backend):
    cands = [(bm, bn, bk) for bm in (32, 64, 128) for bn in (32, 64, 128)
             for bk in (32, 64)]
  else:
    cands = [(b, b, bk) for b in (128, 256, 512, 1024) for bk in (256, 1024)]
  return [{"block_sizes": [min(bm, m), min(bn, n), min(bk, k)]}
          for bm, bn, bk in cands if k % min(bk, k) == 0]


def _flash_space(size, backend):
  s = size[1]
  opts = (32, 64, 128) if _triton(backend) else (128, 256, 512)
  return [{"block_q": bq, "block_k": bk} for bq in opts for bk in opts
          if bq <= s and bk <= s]


# name -> search space of keyword arguments (the config is passed as kwargs;
# the kernel's own choice is the default, config {})
_TUNABLE = {"softmax": _rows_space, "layer_norm": _rows_space,
            "rms_norm": _rows_space, "matmul": _matmul_space,
            "flash_attention": _flash_space}


_TUNABLE_PARAMS = {"softmax": ("block_rows",), "layer_norm": ("block_rows",),
                   "rms_norm": ("block_rows",), "matmul": ("block_sizes",),
                   "flash_attention": ("block_q", "block_k")}


class External(KernelBench):
  source = "kernels"
  pallas_source = False   # kernels/ imports dsl; Pallas cannot run it

  def __init__(self, short: str, fn, reference, own_reference: bool,
               reason: str | None):
    (self.dims_doc, self._ranks, self._cpu_sizes, self._gpu_sizes,
     self._shapes, self._flops, _, self.bound) = _SHAPES[short]
    self.short = short
    self.name = f"kernels.{short}"
    self.fn = fn
    self._reference = reference
    self.own_reference = own_reference
    self.reason = reason
    self.summary = (f"kernels/ library's {short}"
                    + (" (reference: benchmarks' own)" if own_reference else ""))

  def unavailable(self):
    return self.reason

  @property
  def tunable(self):
    space = _TUNABLE.get(self.short)
    if space is None or self.fn is None:
      return False
    try:
      params = inspect.signature(self.fn).parameters
    except (TypeError, ValueError):
      return False
    return all(k in params for k in _TUNABLE_PARAMS[self.short])

  def default_config(self, size, backend, platform):
    return {}   # the kernel's own choice of blocks

  def chosen_config(self, size, backend, platform, dtype):
    """{}: the kernel chooses itself, from the same shipped table when it
    has an entry (shown in the config column, not passed)."""
    hit = self.shipped(size, backend, dtype)
    if hit is None:
      return {}, "default (the kernel's own)"
    return {}, f"shipped: {hit.key} ({hit.where})"

  def shown_config(self, size, backend, dtype, config):
    if config:
      return config
    hit = self.shipped(size, backend, dtype)
    return hit.config if hit else {}

  def auto_backend(self) -> gpu_defaults.BackendChoice | None:
    """The GPU backend the kernel runs on with backend=None here."""
    return gpu_defaults.backend_for(self.name)

  def search_space(self, size, backend, platform):
    return [{}] + _TUNABLE[self.short](size, backend)

  def fix_config(self, size, config, dtype=None):
    c = dict(config)
    if "block_sizes" in c:
      c["block_sizes"] = [int(b) for b in c["block_sizes"]]
    return c

  def normalize(self, dims):
    self.check_dims(dims, self._ranks)
    if self.short == "matmul" and len(dims) == 1:
      return tuple(dims) * 3
    return tuple(dims)

  def default_sizes(self, platform):
    return self._gpu_sizes if platform == "gpu" else self._cpu_sizes

  def quick_sizes(self, platform):
    return self.default_sizes(platform)[:1]

  def inputs(self, size, dtype):
    make = getattr(self.fn, "bench_inputs", None)
    if callable(make):
      return tuple(make(size, dtype))
    return random_inputs(self._shapes(size), dtype)

  def reference(self, *inputs):
    return self._reference(*inputs)

  def build(self, pl, size, dtype, config, **call_kw):
    backend = call_kw.get("backend")
    fn = self.fn
    kwargs = {k: tuple(v) if isinstance(v, list) else v
              for k, v in config.items()}
    def run(*inputs):
      return fn(*inputs, backend=backend, **kwargs)
    return run

  def flops(self, size):
    return self._flops(size)

  def io_bytes(self, size, dtype):
    shapes = self._shapes(size)
    out = shapes[0] if self.short != "matmul" else (size[0], size[2])
    return float(sum(math.prod(s) for s in shapes) + math.prod(out)) * \
        jnp.dtype(dtype).itemsize

  def tolerance(self, dtype):
    return 1e-2 if jnp.dtype(dtype).itemsize >= 4 else 5e-2


def discover() -> list[External]:
  """One entry per known name; absent or malformed ones say why."""
  pkg, err = _import("kernels")
  out = []
  for short in NAMES:
    own_ref = _SHAPES[short][6]
    if pkg is None:
      out.append(External(short, None, own_ref, True,
                          f"kernels/ does not import ({err})"))
      continue
    fn, module = _resolve_function(pkg, short)
    if not callable(fn):
      out.append(External(short, None, own_ref, True,
                          f"kernels/ has no '{short}' yet"))
      continue
    if not _takes_backend(fn):
      out.append(External(short, fn, own_ref, True,
                          f"kernels.{short} has no backend= parameter"))
      continue
    ref = _resolve_reference(pkg, short, fn, module)
    out.append(External(short, fn, ref or own_ref, ref is None, None))
  return out
