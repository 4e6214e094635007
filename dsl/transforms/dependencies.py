"""Which inputs of a jaxpr each of its values depends on."""
from __future__ import annotations

from dsl.core.jax_internals import core


def dependencies(jaxpr: core.Jaxpr, given=None, cuts=None) -> dict:
  """Which jaxpr inputs each variable depends on: per output of a `cond`
  (its index and what that output depends on in some branch) and of a
  call (through the called jaxpr); conservatively (every input of the
  equation) for other equations. `given`: the inputs' own dependencies."""
  deps = {v: ({k} if given is None else given[k])
          for k, v in enumerate(jaxpr.invars)}
  of = lambda v: deps.get(v, set()) if isinstance(v, core.Var) else set()
  for eqn in jaxpr.eqns:
    found = _equationdependencies(eqn, [of(v) for v in eqn.invars])
    for v, d in zip(eqn.outvars, found):
      deps[v] = d if cuts is None or v not in cuts else {cuts[v]}
  return deps


def _equationdependencies(eqn, in_deps) -> list:
  """The dependencies of each output of `eqn`, given its inputs'."""
  name = eqn.primitive.name
  if name == "cond":
    index, ops = in_deps[0], in_deps[1:]
    per_branch = [_outputsdependencies(b.jaxpr, ops) for b in eqn.params["branches"]]
    return [set(index).union(*ds) for ds in zip(*per_branch)]
  called = eqn.params.get("jaxpr") if name in ("pjit", "jit",
                                                "closed_call") else None
  if called is not None:
    return _outputsdependencies(getattr(called, "jaxpr", called), in_deps)
  everything = set().union(*in_deps) if in_deps else set()
  return [everything] * len(eqn.outvars)


def _outputsdependencies(jaxpr: core.Jaxpr, in_deps) -> list:
  deps = dependencies(jaxpr, in_deps)
  return [deps.get(v, set()) if isinstance(v, core.Var) else set()
          for v in jaxpr.outvars]
