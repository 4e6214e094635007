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
from dsl.core.jax_internals import (checkify as jax_checkify, close_jaxpr,
                                    ClosedJaxpr, core)
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


# ------------------------------------------------------------ windows
#
# A window placed at run time that leaves its ref fails the same check on
# every backend, with the same words: `window_access` is the part the
# kernel knows (the access, the window with `{}` for values computed at run
# time, the ref's shape), `window_message` adds where it ran.

WINDOW_FIX = ("keep pl.ds starts and indices computed at run time inside "
              "the ref, or mask the access (pl.load/pl.store with mask=)")


def window_access(verb: str, ref: str, window: str, shape) -> str:
  """`out-of-bounds load from x_ref[{}:{}, :] (a window placed at run time)
  outside its ref of shape (16, 128)`."""
  return (f"out-of-bounds {verb} {ref}[{window}] (a window placed at run "
          f"time) outside its ref of shape {tuple(int(n) for n in shape)}")


def window_message(access: str, block_index=None, point=None) -> str:
  """The message of the failed check: `access` with its values, the block
  index of the ref (None for scratch and whole arrays), the grid point
  (tuples, or text a backend fills in later)."""
  where = []
  if block_index is not None:
    where.append(f"block index {_tuple_text(block_index)}")
  if point is not None:
    where.append(f"grid point {_tuple_text(point)}")
  at = f" at {' and '.join(where)}" if where else ""
  return f"{access}{at}; {WINDOW_FIX}"


def _tuple_text(values) -> str:
  if isinstance(values, str):
    return values
  return str(tuple(int(v) for v in values))


# A block index read from data that puts its block outside the array, with
# runtime asserts on: the same words on every backend.

def block_limits_text(shape, block_sizes, element_padding=None) -> str:
  """`dim 0: block indices below 4; dim 1: ...` for an array of `shape` in
  blocks of `block_sizes`; `element_padding`: {dim: (low, high)} for
  `Element` dims, whose index maps return element offsets."""
  parts = []
  for d, (n, b) in enumerate(zip(shape, block_sizes)):
    if n == 0:
      continue
    if element_padding and d in element_padding:
      lo, hi = element_padding[d]
      parts.append(f"dim {d}: element offsets below {n + lo + hi}")
    else:
      parts.append(f"dim {d}: block indices below {-(-n // b)}")
  return "; ".join(parts)


def index_map_at(bm) -> str | None:
  """`file:line` of a block mapping's index map, or None."""
  info = getattr(bm.index_map_jaxpr.jaxpr, "debug_info", None)
  src = getattr(info, "func_src_info", None) or ""
  return src.split(" at ")[-1] if " at " in src else None


def block_index_message(origin: str, block_index, point, array: str,
                        limits: str, index_map_at: str | None) -> str:
  """`in_specs[0]: block index (9, 0) at grid point (1, 1) is outside the
  array float32[32,128] (dim 0: block indices below 4); ...`. `block_index`
  and `point` are tuples, or text (`{block}`) a backend fills in later."""
  at = f" (index map at {index_map_at})" if index_map_at else ""
  return (f"{origin}: block index {_tuple_text(block_index)} at grid point "
          f"{_tuple_text(point)} is outside the array {array} ({limits}); "
          f"index maps return block indices, not element offsets{at}")


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
  if isinstance(v, ClosedJaxpr):
    return close_jaxpr(map_eqns(v.jaxpr, fn), v.consts)
  if isinstance(v, core.Jaxpr):
    return map_eqns(v, fn)
  if isinstance(v, tuple) and any(isinstance(x, (core.Jaxpr, ClosedJaxpr))
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


def set_check_mode(closed: ClosedJaxpr, runtime: bool,
                   debug_checks: bool = False) -> ClosedJaxpr:
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

  return close_jaxpr(map_eqns(closed.jaxpr, fn), closed.consts)
