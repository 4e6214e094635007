"""Pallas's own kernel library (`jax.experimental.pallas.ops`), swapped onto dsl.

Nothing of Pallas's code lives in this repository: an import hook serves
`pallas_ops_on_dsl.X` from the source of `jax.experimental.pallas.ops.X` in
the installed JAX, with its Pallas imports rewritten to dsl's names
(`import dsl as pl`, `from dsl import tpu as pltpu`, `from dsl import triton
as plgpu`, and for the `*_mgpu` ops `from dsl import mosaic_gpu as plgpu`)
and its imports of sibling ops pointed at the swapped copies. Nothing else
of the source changes, line numbers included, so tracebacks point at the
original file.

    from benchmarks.pallas_library import swap
    swap.install()
    from pallas_ops_on_dsl.tpu import matmul   # Pallas's matmul, on dsl
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys

import jax

from dsl.core import jax_internals
from benchmarks.pallas_library.case import NO_PALLAS_GRAD

# The package name the swapped copies live under.
PREFIX = "pallas_ops_on_dsl"
# The package the sources come from.
ORIGINAL = "jax.experimental.pallas.ops"

# Line-for-line rewrites of Pallas's public imports to dsl's:
# (pattern, replacement). tests/pallas/pallas_suite.py uses them too.
PALLAS_IMPORTS = (
    (re.compile(r"^(\s*)from jax\.experimental import pallas as (\w+)\s*$",
                re.M), r"\1import dsl as \2"),
    (re.compile(r"^(\s*)import jax\.experimental\.pallas as (\w+)\s*$", re.M),
     r"\1import dsl as \2"),
    (re.compile(r"^(\s*)from jax\.experimental\.pallas import "
                r"(tpu|triton|mosaic_gpu) as (\w+)\s*$", re.M),
     r"\1from dsl import \2 as \3"),
    (re.compile(r"^(\s*)import jax\.experimental\.pallas\."
                r"(tpu|triton|mosaic_gpu) as (\w+)\s*$", re.M),
     r"\1from dsl import \2 as \3"),
)
# The rewrites of an op's source: its Pallas imports, and its imports of
# sibling ops pointed at the swapped copies.
REWRITES = PALLAS_IMPORTS + (
    (re.compile(re.escape(ORIGINAL + ".")), PREFIX + "."),
)

# A Pallas import left after the rewrites (the swapped copy would silently
# run part of itself on Pallas).
_LEFT_OVER = re.compile(
    r"^\s*(from|import)\s+jax\.experimental\.pallas\b.*$", re.M)


def ops_dir() -> str:
  """The folder of the installed `jax.experimental.pallas.ops`."""
  return os.path.join(os.path.dirname(jax.__file__), "experimental", "pallas",
                      "ops")


def rewrite(source: str, origin: str = "<source>") -> str:
  """`source` of a Pallas op with its Pallas imports pointed at dsl."""
  for pattern, replacement in REWRITES:
    source = pattern.sub(replacement, source)
  left = _LEFT_OVER.search(source)
  if left is not None:
    raise ImportError(f"{origin}: a Pallas import the swap does not rewrite: "
                      f"{left.group(0).strip()!r}")
  return source


def _source_path(fullname: str) -> tuple[str, bool] | None:
  """(file, is_package) holding the original of swapped module `fullname`,
  or None when it is not one this hook serves."""
  if fullname != PREFIX and not fullname.startswith(PREFIX + "."):
    return None
  parts = fullname.split(".")[1:]
  base = os.path.join(ops_dir(), *parts)
  if os.path.isfile(os.path.join(base, "__init__.py")):
    return os.path.join(base, "__init__.py"), True
  if os.path.isfile(base + ".py"):
    return base + ".py", False
  return None


class _SwapLoader(importlib.abc.Loader):
  """Executes the rewritten source of one op module."""

  def __init__(self, path: str):
    self.path = path

  def create_module(self, spec):
    return None

  def exec_module(self, module):
    with open(self.path, encoding="utf-8") as f:
      source = rewrite(f.read(), self.path)
    with _own_prng_registrations(self.path):
      exec(compile(source, self.path, "exec"), module.__dict__)


@contextlib.contextmanager
def _own_prng_registrations(path: str):
  """Lets the swapped copy of `path` register the PRNG implementations that
  Pallas's original registered already (JAX refuses a name twice), and
  leaves JAX's registry as it was: the swapped copy's implementations are
  used through its functions, not by name."""
  prngs = jax_internals.prng.prngs
  saved = dict(prngs)
  for name, impl in saved.items():
    if getattr(getattr(impl.random_bits, "__code__", None), "co_filename",
               None) == path:
      del prngs[name]
  try:
    yield
  finally:
    prngs.clear()
    prngs.update(saved)


class _SwapFinder(importlib.abc.MetaPathFinder):
  """Finds `PREFIX.X` in the installed `jax.experimental.pallas.ops`."""

  def find_spec(self, fullname, path=None, target=None):
    found = _source_path(fullname)
    if found is None:
      return None
    file, is_package = found
    return importlib.util.spec_from_file_location(
        fullname, file, loader=_SwapLoader(file),
        submodule_search_locations=[os.path.dirname(file)] if is_package
        else None)


_FINDER = _SwapFinder()


def install() -> None:
  """Puts the hook on `sys.meta_path` (once)."""
  if _FINDER not in sys.meta_path:
    sys.meta_path.insert(0, _FINDER)


def swapped(name: str):
  """The swapped copy of `jax.experimental.pallas.ops.<name>` (e.g.
  "tpu.matmul"), imported through the hook."""
  install()
  return importlib.import_module(f"{PREFIX}.{name}")


def original(name: str):
  """Pallas's own `jax.experimental.pallas.ops.<name>`."""
  return importlib.import_module(f"{ORIGINAL}.{name}")


# The dsl backends each family of ops runs on here.
TPU_BACKENDS = ("interpret", "mosaic_interpret")
GPU_BACKENDS = ("interpret", "triton_interpret")
# plgpu kernels (the `*_mgpu` ops) run on the interpret backend's warpgroup
# interpreter.
MGPU_BACKENDS = ("interpret",)


def is_mgpu(op: str) -> bool:
  """Whether op `op` is one of the `*_mgpu` ops (Pallas's Mosaic GPU API)."""
  return op.split(" ")[0].endswith("_mgpu")


def backends_of(op: str) -> tuple[str, ...]:
  """The dsl backends op `op` ("tpu.matmul", "gpu.softmax") is checked on."""
  if is_mgpu(op):
    return MGPU_BACKENDS
  return TPU_BACKENDS if op.startswith("tpu.") else GPU_BACKENDS


def base_op(case_id: str) -> str:
  """The op of OPS a case is of: "tpu.matmul [bfloat16]" -> "tpu.matmul"."""
  return case_id.split(" [", 1)[0]


# Ops compared with their reference only, and why.
NO_PALLAS = {
    "tpu.paged_attention (grad)": NO_PALLAS_GRAD,
    "tpu.all_gather":
        "Pallas's TPU interpret mode returns NaN in parts of the gathered "
        "array here",
    "tpu.ragged_paged_attention":
        "Pallas's TPU interpret mode cannot run it ('ReshapeTransform' object "
        "has no attribute 'indices')",
    "gpu.hopper_mixed_type_matmul_mgpu":
        "Pallas's GPU interpret mode cannot run it (Expected shape (6,) but "
        "got (64, 64))",
    "gpu.attention_mgpu":
        "Pallas's GPU interpret mode cannot run it (Cannot lower jaxpr with "
        "effects: MemoryEffect, _WGMMAPipelineEffect)",
    "gpu.attention_mgpu (causal)":
        "Pallas's GPU interpret mode cannot run it (Cannot lower jaxpr with "
        "effects: MemoryEffect, _WGMMAPipelineEffect)",
    "gpu.blackwell_ragged_dot_mgpu":
        "Pallas's GPU interpret mode cannot run its collective tcgen05 MMAs "
        "(collective_axis not supported yet); the case runs the op with "
        "collective=True, a cluster of 2 blocks: with collective=False the "
        "op reads lax.axis_index('x') of a cluster axis it declares only "
        "with collective=True, its own bug (NameError: unbound axis name x, "
        "in Pallas too)",
    "gpu.collective_matmul_mgpu":
        "Pallas's GPU interpret mode cannot run it (Cannot lower jaxpr with "
        "effects: SemaphoreEffect)",
    "gpu.reduce_scatter_mgpu":
        "Pallas's GPU interpret mode cannot run it (nan + semaphore)",
    "gpu.all_gather_mgpu":
        "Pallas's GPU interpret mode cannot run it (nan + semaphore)",
}

# The ops (cases.CASES has one cheap case for each), in the order of
# docs/pallas-compat.md's table.
OPS = ("tpu.matmul", "tpu.example_kernel", "tpu.all_gather",
       "tpu.flash_attention", "tpu.paged_attention",
       "tpu.paged_attention (grad)", "tpu.splash_attention",
       "tpu.ragged_paged_attention", "tpu.megablox.gmm", "tpu.megablox.tgmm",
       "tpu.megablox.gmm (grad)",
       "tpu.random.threefry", "tpu.random.philox", "gpu.attention",
       "gpu.decode_attention", "gpu.paged_attention", "gpu.layer_norm",
       "gpu.layer_norm (grad)", "gpu.rms_norm", "gpu.rms_norm (grad)",
       "gpu.softmax", "gpu.hopper_matmul_mgpu",
       "gpu.hopper_mixed_type_matmul_mgpu", "gpu.attention_mgpu",
       "gpu.attention_mgpu (causal)", "gpu.ragged_dot_mgpu",
       "gpu.transposed_ragged_dot_mgpu", "gpu.collective_matmul_mgpu",
       "gpu.reduce_scatter_mgpu", "gpu.all_gather_mgpu",
       "gpu.blackwell_matmul_mgpu", "gpu.blackwell_ragged_dot_mgpu")
