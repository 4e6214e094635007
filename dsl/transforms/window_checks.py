"""Run-time checks of ref windows placed at run time (interpret backend).

With jax_pallas_enable_runtime_assert on, a window whose start or indices
are computed at run time (`x_ref[pl.ds(i, 8)]`, `o_ref[idx]`) and that
leaves its ref is a KernelCheckError, worded the same on every backend
(`dsl.core.checks.window_message`): the access, the window with its run-time
values, the ref, the block index and the grid point. The checked kernel
(runtime_checks.py) puts a `window_check` equation before each such access,
naming the ref; its checkify rule asserts that every lane the access uses
lies inside the ref.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from dsl.core.jax_internals import (checkify as jax_checkify, core,
                                    state_indexing as indexing,
                                    state_primitives)
from jax.extend.core import Primitive

from dsl.core import ref_ops, windows
from dsl.core.access import INDEX, SLICE, RefAccess
from dsl.core.checks import window_access
from dsl.core.jaxpr_walk import sub_jaxprs
from dsl.core.operand_layout import (RefLayout, eqn_ref_operands,
                                     ref_operands, register_ref_layout)


class WindowOutsideRef(jax_checkify.FailedCheckError):
  """A window placed at run time that leaves its ref (`ref`: the ref's
  name in messages)."""

  def __init__(self, traceback_info, fmt_string, *a, ref=None, **k):
    super().__init__(traceback_info, fmt_string, *a, **k)
    self.ref = ref

  def tree_flatten(self):
    return ((self.args, self.kwargs),
            (self.traceback_info, self.fmt_string, self.ref))

  @classmethod
  def tree_unflatten(cls, metadata, payload):
    tb, fmt, ref = metadata
    args, kwargs = payload
    return cls(tb, fmt, *args, ref=ref, **kwargs)


window_check_p = Primitive("window_check")
window_check_p.multiple_results = True
window_check_p.def_impl(lambda *args, **params: [])
window_check_p.def_abstract_eval(lambda *avals, **params: [])
# The access's index leaves, then its mask: the ref is not an operand.
_CHECK = RefLayout(after=("mask",), flags=(("mask", "has_mask"),),
                   has_ref=False)
register_ref_layout(window_check_p, _CHECK)

# the ref accesses checked -> the verb of their messages
_ACCESSES = {
    state_primitives.get_p: "load from",
    state_primitives.swap_p: "store to",
    state_primitives.addupdate_p: "update of",
    ref_ops.masked_load_p: "load from",
    ref_ops.masked_store_p: "store to",
    ref_ops.atomic_rmw_p: "atomic update of",
}


def window_check_eqn(eqn, name: str | None, ranges=None):
  """A `window_check` equation for the ref access `eqn` when its window is
  placed by values computed at run time and may leave its ref (what
  `ranges`, the kernel's `dsl.core.ranges.KernelRanges`, proves inside is
  not checked), else None."""
  if eqn.primitive not in _ACCESSES:
    return None
  ops = eqn_ref_operands(eqn)
  if not _leaves_at_run_time(ops, ranges.access(eqn) if ranges else None):
    return None
  shape = tuple(ops.ref.aval.inner_aval.shape)
  invars, layout = _CHECK.flatten(None, leaves=ops.leaves, tree=ops.tree,
                                  mask=ops.mask)
  params = dict(layout, shape=shape, verb=_ACCESSES[eqn.primitive],
                ref=name or "a ref")
  return core.new_jaxpr_eqn(invars, [], window_check_p, params, set(),
                            eqn.source_info, eqn.ctx)


def _leaves_at_run_time(ops, proofs) -> bool:
  """Whether the first indexer of an access (the one that places its
  window) may leave its ref at a place computed at run time: the access
  model's run-time exits (static ones are refused when the kernel is
  traced, or, in derived kernels, read poison), but the sides that the
  range analysis's `proofs` (a `dsl.core.ranges.Access`, or None) prove
  inside, where that indexer is the only one."""
  try:
    transforms = [t for t in ops.transforms if t is not None]
  except ValueError:  # transforms we cannot read: check
    return True
  if not transforms or not isinstance(transforms[0], indexing.NDIndexer):
    return False
  access = RefAccess.of(transforms[0])
  if proofs is not None and len(transforms) == 1:
    access = access.proving(proofs.inside_ref)
  return bool(access.leaving_dims(static=False))


def _indexer_parts(indexer, values: list) -> str:
  """The window in numpy notation, with `{}` for values computed at run
  time (appended to `values`)."""
  parts = []
  for w, n in zip(RefAccess.of(indexer).dims, indexer.shape):
    static = isinstance(w.start, (int, np.integer))
    if w.kind == SLICE:
      stop_off = (w.size - 1) * w.stride + 1
      step = "" if w.stride == 1 else f":{w.stride}"
      if static:
        start = int(w.start)
        parts.append(":" if (start, stop_off) == (0, n) else
                     f"{start}:{start + stop_off}{step}")
      else:
        s = jnp.asarray(w.start, jnp.int32)
        values += [s, s + stop_off]
        parts.append("{}:{}" + step)
    elif w.kind == INDEX:     # a window of one, as the Mosaic backend sees
      if static:
        parts.append(f"{int(w.start)}:{int(w.start) + 1}")
      else:
        s = jnp.asarray(w.start, jnp.int32)
        values += [s, s + 1]
        parts.append("{}:{}")
    else:
      a = jnp.asarray(w.start, jnp.int32)
      values += [jnp.min(a), jnp.max(a)]
      parts.append("indices {} to {}")
  return ", ".join(parts)


def _check_rule(ctx, error, enabled_errors, *args, shape, verb, ref,
                **params):
  ops = ref_operands(window_check_p, args, params)
  transforms = [t for t in ops.transforms if t is not None]
  if not transforms or not isinstance(transforms[0], indexing.NDIndexer):
    return error, []
  # The first indexer places the window; later ones narrow it.
  bad = ~windows.lanes_inside(shape, transforms[0])
  if ops.mask is not None and len(transforms) == 1:
    bad = bad & jnp.broadcast_to(ops.mask, bad.shape)
  values: list = []
  window = _indexer_parts(transforms[0], values)
  fmt = window_access(verb, ref, window, shape)
  exc = WindowOutsideRef(jax_checkify.get_traceback(), fmt, *values, ref=ref)
  return jax_checkify.assert_func(ctx, error, jnp.any(bad), exc), []


jax_checkify.error_checks[window_check_p] = _check_rule


def has_run_time_windows(jaxpr: core.Jaxpr) -> bool:
  """Whether a kernel accesses a ref through a window placed at run time."""
  for eqn in jaxpr.eqns:
    if window_check_eqn(eqn, None) is not None:
      return True
    if any(has_run_time_windows(j) for j in sub_jaxprs(eqn.params)):
      return True
  return False
