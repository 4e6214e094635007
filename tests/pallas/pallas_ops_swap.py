"""Pallas's own kernel library (`jax.experimental.pallas.ops`), swapped onto dsl.

Nothing of Pallas's code lives in this repository: an import hook serves
`pallas_ops_on_dsl.X` from the source of `jax.experimental.pallas.ops.X` in
the installed JAX, with its Pallas imports rewritten to dsl's names
(`import dsl as pl`, `from dsl import tpu as pltpu`, `from dsl import triton
as plgpu`) and its imports of sibling ops pointed at the swapped copies.
Nothing else of the source changes, line numbers included, so tracebacks
point at the original file. The `*_mgpu` ops are not served: they need
Pallas's Mosaic GPU API.

    import tests.pallas.pallas_ops_swap as swap
    swap.install()
    from pallas_ops_on_dsl.tpu import matmul   # Pallas's matmul, on dsl
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys

import jax

# The package name the swapped copies live under.
PREFIX = "pallas_ops_on_dsl"
# The package the sources come from.
ORIGINAL = "jax.experimental.pallas.ops"

# Line-for-line rewrites of the sources: (pattern, replacement).
REWRITES = (
    (re.compile(r"^(\s*)from jax\.experimental import pallas as (\w+)\s*$",
                re.M), r"\1import dsl as \2"),
    (re.compile(r"^(\s*)import jax\.experimental\.pallas as (\w+)\s*$", re.M),
     r"\1import dsl as \2"),
    (re.compile(r"^(\s*)from jax\.experimental\.pallas import "
                r"(tpu|triton) as (\w+)\s*$", re.M),
     r"\1from dsl import \2 as \3"),
    (re.compile(re.escape(ORIGINAL + ".")), PREFIX + "."),
)

# A Pallas import left after the rewrites (the swapped copy would silently
# run part of itself on Pallas).
_LEFT_OVER = re.compile(r"^\s*(from|import)\s+jax\.experimental\.pallas\b",
                        re.M)


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
  if parts and parts[-1].endswith("_mgpu"):
    return None
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
    exec(compile(source, self.path, "exec"), module.__dict__)


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
