"""The interpret backend's discharge of refs: windows that may leave.

JAX's discharge rules of `get`, `swap` and `addupdate` clamp a window placed
at run time back inside its ref (`dynamic_slice`). Before dsl discharges a
kernel or an index map (`discharge`), `bound_windows` replaces each such
equation whose window may leave its ref (the access model's decision,
`dsl.core.access`) with one of dsl's own primitives (`bounded_get`,
`bounded_swap`, `bounded_addupdate`: the same operands, params and
effects), whose discharge rule reads poison and writes nothing outside the
ref (`dsl.core.windows`). JAX's own rules are left as they are, for every
other user of JAX in the process (Pallas's interpreter among them).
"""
from __future__ import annotations

from jax import tree_util
from jax.extend.core import Primitive
from dsl.core.jax_internals import (ClosedJaxpr, core, state_discharge,
                                    state_indexing as indexing,
                                    state_primitives)

from dsl.core import windows
from dsl.core.access import RefAccess


def _bounded(prim: Primitive) -> Primitive:
  """dsl's twin of JAX's ref primitive `prim`."""
  twin = Primitive(f"bounded_{prim.name}")
  twin.multiple_results = prim.multiple_results
  twin.def_effectful_abstract_eval(
      lambda *avals, **params: prim.abstract_eval(*avals, **params))
  return twin


bounded_get_p = _bounded(state_primitives.get_p)
bounded_swap_p = _bounded(state_primitives.swap_p)
bounded_addupdate_p = _bounded(state_primitives.addupdate_p)

# JAX's primitive -> (dsl's twin, where its index leaves start)
_TWINS = {state_primitives.get_p: (bounded_get_p, 1),
          state_primitives.swap_p: (bounded_swap_p, 2),
          state_primitives.addupdate_p: (bounded_addupdate_p, 2)}


def _transforms(tree, idx):
  return tree_util.tree_unflatten(tree, list(idx))


@state_discharge.register_discharge_rule(bounded_get_p)
def _get(ctx, x, *idx, tree):
  return (None,) * (1 + len(idx)), windows.read(x, _transforms(tree, idx))


@state_discharge.register_discharge_rule(bounded_swap_p)
def _swap(ctx, x, val, *idx, tree):
  old, new = windows.update(x, _transforms(tree, idx), lambda old: val)
  return (new, None) + (None,) * len(idx), old


@state_discharge.register_discharge_rule(bounded_addupdate_p)
def _addupdate(ctx, x, val, *idx, tree):
  _, new = windows.update(x, _transforms(tree, idx),
                          lambda old: old + val)
  return (new, None) + (None,) * len(idx), []


# ------------------------------------------------------------ the rewrite

def _may_leave(eqn, first: int) -> bool:
  """Whether a window of `eqn` (JAX's get/swap/addupdate) may leave its
  ref, its index atoms read as the access model reads them (a literal is
  static, a variable computed at run time)."""
  tree = eqn.params["tree"]
  try:
    transforms = _transforms(tree, eqn.invars[first:first + tree.num_leaves])
  except Exception:  # noqa: BLE001 - transforms we cannot read: bound them
    return True
  return any(isinstance(t, indexing.NDIndexer)
             and RefAccess.of(t).may_leave() for t in transforms)


def _param(value):
  if isinstance(value, ClosedJaxpr):
    inner = bound_windows(value.jaxpr)
    return value if inner is value.jaxpr else value.replace(jaxpr=inner)
  if isinstance(value, core.Jaxpr):
    return bound_windows(value)
  if isinstance(value, (tuple, list)) and any(
      isinstance(v, (core.Jaxpr, ClosedJaxpr)) for v in value):
    return type(value)(_param(v) for v in value)
  return value


def bound_windows(jaxpr: core.Jaxpr) -> core.Jaxpr:
  """`jaxpr` with every ref read or write whose window may leave its ref
  made dsl's bounded twin (in sub-jaxprs too); `jaxpr` itself when none
  may."""
  eqns, changed = [], False
  for eqn in jaxpr.eqns:
    new = eqn
    twin = _TWINS.get(eqn.primitive)
    if twin is not None and _may_leave(eqn, twin[1]):
      new = eqn.replace(primitive=twin[0])
    params = {k: _param(v) for k, v in eqn.params.items()}
    if any(params[k] is not v for k, v in eqn.params.items()):
      new = new.replace(params=params)
    changed |= new is not eqn
    eqns.append(new)
  return jaxpr.replace(eqns=eqns) if changed else jaxpr


def discharge(closed: ClosedJaxpr, should_discharge) -> ClosedJaxpr:
  """`state_discharge.discharge_state` of `closed` (memory spaces
  stripped), windows that may leave their ref reading poison and writing
  nothing outside it."""
  inner = bound_windows(closed.jaxpr)
  if inner is not closed.jaxpr:
    closed = closed.replace(jaxpr=inner)
  return state_discharge.discharge_state(closed,
                                         should_discharge=should_discharge,
                                         strip_memory_space=True)
