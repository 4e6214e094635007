"""Functions named on a command line: `pkg.mod:fn` or `path/to/file.py:fn`
(the benchmark CLI's `--kernel`, the verification CLI's target)."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys


class TargetError(ValueError):
  """A target that does not name a function; the message says why."""


def load_function(target: str):
  """The function `target` names: `module:function` (the current directory
  is importable) or `file.py:function`; a dotted path after the colon reaches
  attributes (`mod:Class.method`)."""
  mod_name, _, fn_name = target.rpartition(":")
  if not mod_name or not fn_name:
    raise TargetError(f"{target!r}: expected module:function, e.g. "
                      "mypkg.mymod:fn or path/to/file.py:fn")
  try:
    module = _import(mod_name)
  except Exception as e:  # noqa: BLE001 - reported in one line
    raise TargetError(f"{target!r}: cannot import {mod_name}: "
                      f"{type(e).__name__}: {e}".splitlines()[0]) from None
  fn = module
  for part in fn_name.split("."):
    fn = getattr(fn, part, None)
    if fn is None:
      raise TargetError(f"{target!r}: {mod_name} has no {fn_name!r}")
  if not callable(fn):
    raise TargetError(f"{target!r} is not a function")
  return fn


def _import(mod_name: str):
  if mod_name.endswith(".py") or os.sep in mod_name:
    spec = importlib.util.spec_from_file_location(
        os.path.splitext(os.path.basename(mod_name))[0], mod_name)
    if spec is None or spec.loader is None:
      raise ImportError(f"no such file {mod_name}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
  if os.getcwd() not in sys.path:
    sys.path.insert(0, os.getcwd())
  return importlib.import_module(mod_name)
