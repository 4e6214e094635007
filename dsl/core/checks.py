"""Runtime checks inside kernels: `debug_check` and `checkify.check`.

Both become JAX's `check` primitive in the kernel jaxpr (`debug_check` as a
debug-only one). When a kernel is traced, each check is made run-time (a
failing check raises when the kernel runs) or debug-only (ignored, unless
the caller functionalizes it with `checkify.checkify`, which returns the
error as a value):

- with `jax_pallas_enable_runtime_assert` on, every check is run-time;
- with JAX's `jax_pallas_enable_debug_checks` on, `debug_check`s are
  run-time (as Pallas does); `checkify.check`s follow the first option;
- with both off (the default), every check is debug-only.
"""
from __future__ import annotations

import re

from jax import tree_util
from jax._src import checkify as jax_checkify
from jax._src import core
from jax.experimental import checkify

from dsl.core.jaxpr_walk import sub_jaxprs

check_p = jax_checkify.check_p

_CHECK_AT = re.compile(r"^(.*) \(check at (\S+:\d+)\)$", re.S)


def check_message(error, code=None) -> str:
  """The message of a check's error value, as written (its format string);
  `code` picks one check of several."""
  metadata = getattr(error, "_metadata", None) or {}
  treedefs = [metadata[code]] if code in metadata else list(metadata.values())
  messages = []
  for md in treedefs:
    exc = tree_util.tree_unflatten(md, [None] * md.num_leaves)
    messages.append(getattr(exc, "fmt_string", None) or type(exc).__name__)
  return "; ".join(messages) or "check failed"


def check_text(message: str, where: str | None) -> str:
  """How a compiled check carries its message and user line (the text of a
  `tl.device_assert` or `cf.assert`); `split_check_text` reads it back."""
  return f"{message} (check at {where})" if where else message


def split_check_text(text: str) -> tuple[str, str | None]:
  m = _CHECK_AT.match(text.strip())
  return (m.group(1), m.group(2)) if m else (text.strip(), None)


def debug_check(condition, message: str = "debug_check failed", *fmt_args,
                **fmt_kwargs) -> None:
  """Checks `condition` inside a kernel when jax_pallas_enable_debug_checks
  or jax_pallas_enable_runtime_assert is on (see the module docstring)."""
  checkify.debug_check(condition, message, *fmt_args, **fmt_kwargs)


def has_checks(jaxpr: core.Jaxpr) -> bool:
  for eqn in jaxpr.eqns:
    if eqn.primitive is check_p:
      return True
    if any(has_checks(j) for j in sub_jaxprs(eqn.params)):
      return True
  return False


def _map_param(v, fn):
  if isinstance(v, core.ClosedJaxpr):
    return core.ClosedJaxpr(map_eqns(v.jaxpr, fn), v.consts)
  if isinstance(v, core.Jaxpr):
    return map_eqns(v, fn)
  if isinstance(v, tuple) and any(isinstance(x, (core.Jaxpr, core.ClosedJaxpr))
                                  for x in v):
    return tuple(_map_param(x, fn) for x in v)
  return v


def map_eqns(jaxpr: core.Jaxpr, fn) -> core.Jaxpr:
  """Applies `fn` to every equation, in sub-jaxprs too."""
  eqns = []
  for eqn in jaxpr.eqns:
    params = {k: _map_param(v, fn) for k, v in eqn.params.items()}
    eqns.append(fn(eqn.replace(params=params)))
  return jaxpr.replace(eqns=eqns)


def set_check_mode(closed: core.ClosedJaxpr, runtime: bool,
                   debug_checks: bool = False) -> core.ClosedJaxpr:
  """Makes the checks of a kernel jaxpr run-time (raise) or debug-only:
  every check with `runtime` (jax_pallas_enable_runtime_assert), the
  `debug_check`s with `debug_checks` (jax_pallas_enable_debug_checks)."""
  if not has_checks(closed.jaxpr):
    return closed

  def fn(eqn):
    if eqn.primitive is check_p:
      checked = runtime or (debug_checks and eqn.params["debug"])
      return eqn.replace(params=dict(eqn.params, debug=not checked))
    return eqn

  return core.ClosedJaxpr(map_eqns(closed.jaxpr, fn), closed.consts)
