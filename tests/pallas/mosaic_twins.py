"""The kernels of kernels/ run by `jax.experimental.pallas` instead of dsl.

`twin("kernels.softmax")` executes the module's source again with `dsl` /
`dsl.tpu` bound to thin wrappers of `jax.experimental.pallas` / `.tpu`
(dsl's `backend=` argument dropped; names JAX 0.11 moved from `pltpu` to
`pl` looked up in both), so the same kernel code is lowered by Pallas, and
the golden test compares the two Mosaic modules. Other `kernels.*` modules
the source imports are twinned too.
"""
from __future__ import annotations

import importlib
import inspect
import re
import sys
import types

from jax.experimental import pallas as _jpl
from jax.experimental.pallas import tpu as _jpltpu


class _Shim(types.ModuleType):
  def __init__(self, name, primary, fallback):
    super().__init__(name)
    self._primary, self._fallback = primary, fallback

  def __getattr__(self, name):
    try:
      return getattr(self._primary, name)
    except AttributeError:
      return getattr(self._fallback, name)


def _pallas_call(kernel, out_shape, *, backend=None, **kw):
  del backend
  return _jpl.pallas_call(kernel, out_shape, **kw)


pl = _Shim("pallas_twin_pl", _jpl, _jpltpu)
pl.pallas_call = _pallas_call
pltpu = _Shim("pallas_twin_pltpu", _jpltpu, _jpl)

_TWINS: dict = {}


def _flat(modname: str) -> str:
  return "pallas_twin_" + modname.replace(".", "_")


def twin(modname: str) -> types.ModuleType:
  if modname in _TWINS:
    return _TWINS[modname]
  src = inspect.getsource(importlib.import_module(modname))
  src = src.replace("import dsl as pl\n",
                    "from tests.pallas.mosaic_twins import pl\n")
  src = src.replace("from dsl import tpu as pltpu\n",
                    "from tests.pallas.mosaic_twins import pltpu\n")
  for dep in set(re.findall(r"^from (kernels\.\w+) import", src, re.M)):
    if dep != "kernels.blocking":
      twin(dep)
      src = src.replace(f"from {dep} import", f"from {_flat(dep)} import")
  mod = types.ModuleType(_flat(modname))
  mod.__file__ = importlib.import_module(modname).__file__
  sys.modules[mod.__name__] = mod
  exec(compile(src, mod.__file__, "exec"), mod.__dict__)
  _TWINS[modname] = mod
  return mod
