"""Ping-pong: the tensor-core phases of a step that consumers take turns at.

A step whose body issues a wgmma, works on its result in registers and
then issues another wgmma on what that work gave (attention: QK^T, the
softmax, PV) leaves the tensor core idle during the work. Two consumer
warpgroups fill it in turns (schedule.py): each issues its step's last
wgmma and its next step's first while the other does its work. The turns
go after the issue of the first of these wgmmas (before its wait) and
before the issue of the last: `phases` finds those two equations, and the
dot rule (rules/dot.py) emits the turn ops the schedule puts there
(`GpuHost.take_turns`).
"""
from __future__ import annotations

from jax import lax
from dsl.core.jax_internals import core

from lowering_mosaic.gpu.accumulators import dot_accumulate_p

WGMMA_PRIMITIVES = (lax.dot_general_p, dot_accumulate_p)


def _vars(atoms):
  return [v for v in atoms if isinstance(v, core.Var)]


def phases(body) -> tuple | None:
  """(first, last): the first and last wgmma equations at the top level of
  the step's body (`plan.body`; dots inside branches or loops do not run
  once per step) when the last reads what the first computed through work
  between them (an equation that is not a wgmma); else None."""
  if body is None:
    return None
  eqns = body.jaxpr.jaxpr.eqns
  dots = [i for i, e in enumerate(eqns) if e.primitive in WGMMA_PRIMITIVES]
  if len(dots) < 2:
    return None
  first, last = dots[0], dots[-1]
  derived = set(eqns[first].outvars)    # from the first dot
  worked = set()                        # ... through work between
  for e in eqns[first + 1:last]:
    reads = set(_vars(e.invars))
    if reads & worked or (reads & derived
                          and e.primitive not in WGMMA_PRIMITIVES):
      worked.update(e.outvars)
    elif reads & derived:
      derived.update(e.outvars)
  if not set(_vars(eqns[last].invars)) & worked:
    return None
  return eqns[first], eqns[last]
