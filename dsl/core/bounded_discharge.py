"""The interpret backend's discharge of refs: windows that may leave.

JAX's discharge rules of `get`, `swap` and `addupdate` clamp a window placed
at run time back inside its ref (`dynamic_slice`). Before dsl discharges a
kernel or an index map (`discharge`), `bound_windows` replaces each such
equation whose window may leave its ref (the access model's decision,
`dsl.core.access`), and each write through a strided slice, with one of
dsl's own primitives (`bounded_get`, `bounded_swap`, `bounded_addupdate`:
the same operands, params and effects), whose discharge rule reads poison
and writes nothing outside the ref (`dsl.core.windows`). JAX's own rules
are left as they are, for every other user of JAX in the process
(Pallas's interpreter among them).
"""
from __future__ import annotations

from jax.extend.core import Primitive
from dsl.core.jax_internals import (ClosedJaxpr, core, state_discharge,
                                    state_indexing as indexing,
                                    state_primitives)

from dsl.core import windows
from dsl.core.access import RefAccess
from dsl.core.operand_layout import (REF_LAYOUTS, eqn_ref_operands,
                                     ref_operands, register_ref_layout)


def _bounded(prim: Primitive) -> Primitive:
  """dsl's twin of JAX's ref primitive `prim` (its operands laid out as
  `prim`'s)."""
  twin = Primitive(f"bounded_{prim.name}")
  twin.multiple_results = prim.multiple_results
  twin.def_effectful_abstract_eval(
      lambda *avals, **params: prim.abstract_eval(*avals, **params))
  register_ref_layout(twin, REF_LAYOUTS[prim])
  return twin


bounded_get_p = _bounded(state_primitives.get_p)
bounded_swap_p = _bounded(state_primitives.swap_p)
bounded_addupdate_p = _bounded(state_primitives.addupdate_p)

# JAX's primitive -> dsl's twin
_TWINS = {state_primitives.get_p: bounded_get_p,
          state_primitives.swap_p: bounded_swap_p,
          state_primitives.addupdate_p: bounded_addupdate_p}


@state_discharge.register_discharge_rule(bounded_get_p)
def _get(ctx, *args, **params):
  ops = ref_operands(bounded_get_p, args, params)
  return (None,) * len(args), windows.read(ops.ref, ops.transforms)


@state_discharge.register_discharge_rule(bounded_swap_p)
def _swap(ctx, *args, **params):
  ops = ref_operands(bounded_swap_p, args, params)
  old, new = windows.update(ops.ref, ops.transforms, lambda old: ops.value)
  return (new,) + (None,) * (len(args) - 1), old


@state_discharge.register_discharge_rule(bounded_addupdate_p)
def _addupdate(ctx, *args, **params):
  ops = ref_operands(bounded_addupdate_p, args, params)
  _, new = windows.update(ops.ref, ops.transforms,
                          lambda old: old + ops.value)
  return (new,) + (None,) * (len(args) - 1), []


# ------------------------------------------------------------ the rewrite

def _needs_twin(eqn) -> bool:
  """Whether dsl discharges `eqn` (JAX's get/swap/addupdate) otherwise
  than JAX: a window of it may leave its ref (the access model's decision,
  its index atoms read as a literal is static, a variable computed at run
  time), or it writes through a strided slice (`windows.write_one` spreads
  the value with a pad, whose transpose is a strided read, where JAX's
  scatter would transpose to a gather)."""
  try:
    transforms = eqn_ref_operands(eqn).transforms
  except ValueError:  # transforms we cannot read: bound them
    return True
  indexers = [t for t in transforms if isinstance(t, indexing.NDIndexer)]
  writes = eqn.primitive is not state_primitives.get_p
  return any(RefAccess.of(t).may_leave() for t in indexers) or (
      writes and any(w.stride != 1 for t in indexers
                     for w in RefAccess.of(t).dims))


def _param(value, swap):
  if isinstance(value, ClosedJaxpr):
    inner = _rewrite(value.jaxpr, swap)
    return value if inner is value.jaxpr else value.replace(jaxpr=inner)
  if isinstance(value, core.Jaxpr):
    return _rewrite(value, swap)
  if isinstance(value, (tuple, list)) and any(
      isinstance(v, (core.Jaxpr, ClosedJaxpr)) for v in value):
    return type(value)(_param(v, swap) for v in value)
  return value


def _rewrite(jaxpr: core.Jaxpr, swap) -> core.Jaxpr:
  """`jaxpr` with the primitive of each equation (in sub-jaxprs too) that
  `swap(eqn)` gives one replaced by it; `jaxpr` itself when none is."""
  eqns, changed = [], False
  for eqn in jaxpr.eqns:
    new = eqn
    prim = swap(eqn)
    if prim is not None:
      new = eqn.replace(primitive=prim)
    params = {k: _param(v, swap) for k, v in eqn.params.items()}
    if any(params[k] is not v for k, v in eqn.params.items()):
      new = new.replace(params=params)
    changed |= new is not eqn
    eqns.append(new)
  return jaxpr.replace(eqns=eqns) if changed else jaxpr


def _twin(eqn):
  twin = _TWINS.get(eqn.primitive)
  return twin if twin is not None and _needs_twin(eqn) else None


_ORIGINALS = {twin: prim for prim, twin in _TWINS.items()}


def bound_windows(jaxpr: core.Jaxpr) -> core.Jaxpr:
  """`jaxpr` with every ref read or write that dsl discharges otherwise
  than JAX (`_needs_twin`) made dsl's twin of it (in sub-jaxprs too);
  `jaxpr` itself when there is none."""
  return _rewrite(jaxpr, _twin)


def discharge(closed: ClosedJaxpr, should_discharge) -> ClosedJaxpr:
  """`state_discharge.discharge_state` of `closed` (memory spaces
  stripped), windows that may leave their ref reading poison and writing
  nothing outside it. The accesses of refs it keeps (`should_discharge`
  False) stay JAX's primitives, for the transformations that follow."""
  inner = bound_windows(closed.jaxpr)
  if inner is not closed.jaxpr:
    closed = closed.replace(jaxpr=inner)
  # lower=False: calls of `jax.custom_jvp` functions stay calls, so that a
  # derivation differentiates them by their own rules (a softmax's jvp
  # written in its result); the lowerings inline them.
  out = state_discharge.discharge_state(closed,
                                        should_discharge=should_discharge,
                                        lower=False,
                                        strip_memory_space=True)
  kept = _rewrite(out.jaxpr, lambda eqn: _ORIGINALS.get(eqn.primitive))
  return out if kept is out.jaxpr else out.replace(jaxpr=kept)
