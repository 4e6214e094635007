"""A grid point's pure function with one grid id known: at a dim's first
step, at its last, or anywhere in between.

`pl.when(k == 0)` and `pl.when(k == nk - 1)` are `cond`s on comparisons of
a program id; with that id fixed (or known to lie strictly inside its range)
the comparisons are decided and the `cond`s become the branch they take, so
what a step does to its state can be read off the jaxpr.
"""
from __future__ import annotations

import operator

import jax
import numpy as np

from dsl.core.jax_internals import core

# comparison -> the operator on (id, constant) it applies
_COMPARISONS = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt,
                "le": operator.le, "gt": operator.gt, "ge": operator.ge}
_FLIPPED = {"eq": "eq", "ne": "ne", "lt": "gt", "le": "ge", "gt": "lt",
            "ge": "le"}
_CALLS = ("pjit", "jit", "closed_call")


def _concrete(x) -> bool:
  return not isinstance(x, core.Tracer)


def _decided(name, lo, hi, c):
  """`id <name> c` for every id in [lo, hi], or None when it depends."""
  op = _COMPARISONS[name]
  at = {op(lo, c), op(hi, c)}
  if name in ("eq", "ne") and lo < c < hi:
    at.add(not op(lo, c))
  return at.pop() if len(at) == 1 else None


def _fold_comparison(eqn, ins, inside):
  """The value of a comparison of the id known to lie in `inside` =
  (tracer, lo, hi) with a constant, or None."""
  if inside is None or eqn.primitive.name not in _COMPARISONS:
    return None
  tracer, lo, hi = inside
  a, b = ins
  name = eqn.primitive.name
  if b is tracer and _concrete(a) and np.ndim(a) == 0:
    a, b, name = b, a, _FLIPPED[name]
  if a is not tracer or not _concrete(b) or np.ndim(b) != 0:
    return None
  got = _decided(name, lo, hi, int(b))
  return None if got is None else [np.bool_(got)]


def _bind(eqn, ins):
  params = eqn.primitive.get_bind_params(eqn.params)
  if all(_concrete(x) for x in ins) and not eqn.effects:
    with jax.ensure_compile_time_eval():
      out = eqn.primitive.bind(*ins, **params)
  else:
    out = eqn.primitive.bind(*ins, **params)
  return out if eqn.primitive.multiple_results else [out]


def evaluate(jaxpr: core.Jaxpr, consts, args, inside=None):
  """Evaluates `jaxpr` (under a trace), deciding `cond`s whose index is
  known and comparisons of the id `inside` = (tracer, lo, hi) lies in."""
  env = {}
  read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
  for v, x in zip(jaxpr.constvars, consts):
    env[v] = x
  for v, x in zip(jaxpr.invars, args):
    env[v] = x
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    outs = _fold_comparison(eqn, ins, inside)
    name = eqn.primitive.name
    if outs is not None:
      pass
    elif name == "cond" and _concrete(ins[0]):
      branches = eqn.params["branches"]
      b = branches[int(np.clip(int(ins[0]), 0, len(branches) - 1))]
      outs = evaluate(b.jaxpr, b.consts, ins[1:], inside)
    elif name in _CALLS:
      called = eqn.params["jaxpr"]
      outs = evaluate(called.jaxpr, called.consts, ins, inside)
    else:
      outs = _bind(eqn, ins)
    for v, x in zip(eqn.outvars, outs):
      env[v] = x
  return [read(v) for v in jaxpr.outvars]


def at_step(closed, n_ids: int, dim: int, size: int, step: str,
            avals) -> core.ClosedJaxpr:
  """`closed` (whose first `n_ids` inputs are the grid ids) traced with id
  `dim` at `step`: "first" (0), "last" (`size - 1`) or "inside" (strictly
  between). `avals`: its inputs' shapes and dtypes."""
  def f(*args):
    args = list(args)
    inside = None
    if step == "first":
      args[dim] = np.int32(0)
    elif step == "last":
      args[dim] = np.int32(size - 1)
    else:
      inside = (args[dim], 1, size - 2)
    return evaluate(closed.jaxpr, closed.consts, args, inside)
  return jax.make_jaxpr(f)(*avals)
