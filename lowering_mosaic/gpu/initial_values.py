"""The carried accumulators' values before the first step, and which of
them only the tensor core writes inside the loop.

- **Initialization hoisted out of the loop.** A kernel initializes its
  accumulators with `pl.when(step == 0)`; once they are carried
  (accumulators.py) that is a `cond` at every step choosing between the
  carried values and the initial ones. When the `cond` only initializes
  (its predicate is "every sequential grid id is 0", its false branch
  returns the carried values unchanged, its true branch computes values
  from constants alone, and nothing else reads those carried values), it
  is removed from the body and its true branch becomes the loop's initial
  values: at step 0 the body then starts from exactly the values the
  `cond` would have chosen, at later steps from the carried ones, as
  before.
- **Tensor-core accumulators.** A carried value whose only use at each
  step is the accumulator of one WGMMA (`dot_accumulate`), and whose new
  value is that of a WGMMA read elsewhere only on the last step, is
  written by nothing but WGMMAs of one shape inside the loop: PTX orders
  those without a `wgmma.fence`, so one fence after its initial value,
  before the loop, covers it (kernel.py); every other WGMMA accumulator
  is fenced where it is used (rules/dot.py).
"""
from __future__ import annotations

import collections
import dataclasses

from jax import lax
from dsl.core.jax_internals import close_jaxpr, core, partial_eval as pe

from lowering_mosaic.gpu.accumulators import Body, dot_accumulate_p


def _tested_dims(defs, var, ids, value_of) -> set[int] | None:
  """The grid dims d that the boolean (or its 0/1 integer) `var` tests,
  all together, as `id_d == value_of(d)`; None if it is anything else."""
  eqn = defs.get(var)
  if eqn is None:
    return None
  if eqn.primitive in (lax.convert_element_type_p, lax.and_p):
    parts = [_tested_dims(defs, v, ids, value_of) for v in eqn.invars]
    return None if any(p is None for p in parts) else set().union(*parts)
  if eqn.primitive is lax.eq_p:
    a, b = eqn.invars
    for x, y in ((a, b), (b, a)):
      if (isinstance(y, core.Literal) and isinstance(x, core.Var)
          and x in ids and int(y.val) == value_of(ids[x])):
        return {ids[x]}
  return None


def is_step(jaxpr, var, grid, sequential, which: str) -> bool:
  """Whether `var` of `jaxpr` (whose first inputs are the grid ids) holds
  exactly on the first (`which` "first") or last ("last") sequential
  step."""
  defs = {v: e for e in jaxpr.eqns for v in e.outvars}
  ids = {v: d for d, v in enumerate(jaxpr.invars[:len(grid)])}
  value_of = (lambda d: 0) if which == "first" else (lambda d: grid[d] - 1)
  dims = _tested_dims(defs, var, ids, value_of)
  return (dims is not None and dims <= set(sequential)
          and dims >= {d for d in sequential if grid[d] > 1})


def _uses(jaxpr) -> collections.Counter:
  uses = collections.Counter(v for e in jaxpr.eqns for v in e.invars
                             if isinstance(v, core.Var))
  uses.update(v for v in jaxpr.outvars if isinstance(v, core.Var))
  return uses


def _initialization(jaxpr, eqn, carried, uses, grid, sequential):
  """(the carried inputs `eqn`'s results replace, the jaxpr of their
  initial values) if `eqn` only initializes carried values on the first
  step; else None."""
  if (eqn.primitive is not lax.cond_p or eqn.effects
      or len(eqn.params["branches"]) != 2
      or not is_step(jaxpr, eqn.invars[0], grid, sequential, "first")):
    return None
  keep, init = eqn.params["branches"]
  operands = eqn.invars[1:]
  sources = []
  for out in keep.jaxpr.outvars:
    if not isinstance(out, core.Var) or out not in keep.jaxpr.invars:
      return None
    src = operands[keep.jaxpr.invars.index(out)]
    if src not in carried or uses[src] != 1 or src in sources:
      return None
    sources.append(src)
  values, used = pe.dce_jaxpr(init.jaxpr, [True] * len(sources))
  if any(used):
    return None
  return sources, close_jaxpr(values, init.consts)


def hoist_initialization(body: Body, grid, sequential) -> Body:
  """`body` with a `pl.when(step == 0)` that only initializes carried
  values moved into the loop's initial values (see the module doc), and
  its tensor-core accumulators found."""
  if not body.carried:
    return body
  closed = body.jaxpr
  jaxpr = closed.jaxpr
  rank = len(grid)
  carried = {jaxpr.invars[rank + p]: k for k, p in enumerate(body.carried)}
  uses = _uses(jaxpr)
  for i, eqn in enumerate(jaxpr.eqns):
    found = _initialization(jaxpr, eqn, carried, uses, grid, sequential)
    if found is not None:
      break
  else:
    return _with_tensor_core(body, grid, sequential)
  sources, values = found
  subst = dict(zip(eqn.outvars, sources))
  swap = lambda vs: [subst.get(v, v) if isinstance(v, core.Var) else v
                     for v in vs]
  eqns = [e.replace(invars=swap(e.invars))
          for j, e in enumerate(jaxpr.eqns) if j != i]
  rewritten = jaxpr.replace(eqns=eqns, outvars=swap(jaxpr.outvars))
  rewritten, _ = pe.dce_jaxpr(rewritten, [True] * len(rewritten.outvars),
                              instantiate=True)
  out = dataclasses.replace(
      body, jaxpr=close_jaxpr(rewritten, closed.consts), initial=values,
      initialized=tuple(carried[s] for s in sources))
  return _with_tensor_core(out, grid, sequential)


def _with_tensor_core(body: Body, grid, sequential) -> Body:
  """`body` with `tensor_core`: the carried values only WGMMAs write in the
  loop (see the module doc)."""
  jaxpr = body.jaxpr.jaxpr
  rank = len(grid)
  uses = _uses(jaxpr)
  defs = {v: e for e in jaxpr.eqns for v in e.outvars}
  acc_of = {e.invars[2]: e for e in jaxpr.eqns
            if e.primitive is dot_accumulate_p}
  found = []
  for k, p in enumerate(body.carried):
    var, new = jaxpr.invars[rank + p], jaxpr.outvars[k]
    producer = defs.get(new)
    if (uses[var] != 1 or var not in acc_of or producer is None
        or producer.primitive is not dot_accumulate_p):
      continue
    readers = [e for e in jaxpr.eqns if new in e.invars]
    if all(e.primitive is lax.cond_p and is_step(jaxpr, e.invars[0], grid, sequential, "last")
           for e in readers) and uses[new] == len(readers) + 1:
      found.append(k)
  return dataclasses.replace(body, tensor_core=tuple(found))
