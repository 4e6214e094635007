"""Algebraic clean-up of the kernels a derivation builds.

JAX's transposition of a grid point's tangent map leaves work a person would
not write: a `cond` (a `pl.when` of the forward) whose branches all give the
same zeros, additions of those zeros, selects between equal cases, and the
values only those feed. In a derived kernel each costs instructions in the
hot loop (a select per element, a register tile of zeros).
`simplify_closed` folds these away and drops what only they used, and
computes transposed the tiles that a dot contracts along their leading
dim (`transposed_tiles`).
"""
from __future__ import annotations

import math

import numpy as np
from jax import lax

from dsl.core.jax_internals import (ClosedJaxpr, close_jaxpr, core,
                                    linear_util as lu,
                                    partial_eval as pe, source_info_util)
from dsl.transforms.transposed_tiles import transposed

_ADDS = ("add", "add_any")
_ZERO = object()     # a cond branch's result that is all zeros


def _zero_literal(x) -> bool:
  return isinstance(x, core.Literal) and not np.any(np.asarray(x.val))


class _Facts:
  """What is known of the values of one jaxpr: zeros and aliases."""

  def __init__(self):
    self.alias = {}
    self.zero = set()

  def resolve(self, v):
    while isinstance(v, core.Var) and v in self.alias:
      v = self.alias[v]
    return v

  def is_zero(self, v) -> bool:
    v = self.resolve(v)
    return _zero_literal(v) or (isinstance(v, core.Var) and v in self.zero)


def _branch_result(branch, k, ins, facts):
  """What output `k` of a cond branch is, in the cond's own terms: _ZERO,
  an input of the cond, or None."""
  jx = branch.jaxpr
  inner = _Facts()
  _scan(jx, inner)
  v = inner.resolve(jx.outvars[k])
  if inner.is_zero(v):
    return _ZERO
  if isinstance(v, core.Var) and v in jx.invars:
    got = facts.resolve(ins[jx.invars.index(v)])
    if facts.is_zero(got):
      return _ZERO
    return got if isinstance(got, core.Var) else None
  return None


def _scan(jx, facts: _Facts) -> None:
  """Records in `facts` the zeros and aliases `jx`'s equations make."""
  for eqn in jx.eqns:
    name, ins = eqn.primitive.name, eqn.invars
    out = eqn.outvars[0] if eqn.outvars else None
    if name == "broadcast_in_dim" and facts.is_zero(ins[0]):
      facts.zero.add(out)
    elif (name in _ADDS and len(ins) == 2
          and ins[0].aval.shape == ins[1].aval.shape == out.aval.shape):
      if facts.is_zero(ins[0]):
        facts.alias[out] = facts.resolve(ins[1])
      elif facts.is_zero(ins[1]):
        facts.alias[out] = facts.resolve(ins[0])
    elif name == "select_n":
      cases = [facts.resolve(c) for c in ins[1:]]
      if (all(isinstance(c, core.Var) and c is cases[0] for c in cases)
          and ins[1].aval.shape == out.aval.shape):
        facts.alias[out] = cases[0]
    elif name == "cond":
      _scan_cond(eqn, facts)


def _scan_cond(eqn, facts):
  branches, ops = eqn.params["branches"], eqn.invars[1:]
  for k, out in enumerate(eqn.outvars):
    found = [_branch_result(b, k, ops, facts) for b in branches]
    got = found[0]
    if got is None or any(f is not got for f in found):
      continue
    if got is _ZERO:
      facts.zero.add(out)
    elif got.aval.shape == out.aval.shape and got.aval.dtype == out.aval.dtype:
      facts.alias[out] = got


def simplify_closed(closed: ClosedJaxpr) -> ClosedJaxpr:
  """`closed` (a derived kernel's jaxpr) with its known zeros and aliases
  substituted, then pruned; `closed` itself when there are none."""
  jx = closed.jaxpr
  facts = _Facts()
  facts.zero |= {v for v, x in zip(jx.constvars, closed.consts)
                 if not isinstance(x, core.Tracer) and not np.any(x)}
  _scan(jx, facts)
  defs = {v: e for e in jx.eqns for v in e.outvars}
  divisions = {id(e): d for e in jx.eqns
               if (d := _division_by_broadcast(e, defs)) is not None}
  swaps = {id(e): d for e in jx.eqns
           if (d := _transposed_dot(e, defs)) is not None}
  if not facts.zero and not facts.alias and not divisions and not swaps:
    return transposed(closed)
  zeros = {v: np.zeros(v.aval.shape, v.aval.dtype) for v in facts.zero}

  def f(*args):
    env = dict(zip(jx.constvars, closed.consts))
    env.update(zip(jx.invars, args))

    def read(v):
      v = facts.resolve(v)
      if isinstance(v, core.Literal):
        return v.val
      return zeros[v] if v in zeros else env[v]   # v: a Var here
    for eqn in jx.eqns:
      if not eqn.effects and all(o in facts.alias or o in zeros
                                 for o in eqn.outvars):
        continue
      params = eqn.primitive.get_bind_params(eqn.params)
      with source_info_util.user_context(eqn.source_info.traceback):
        if id(eqn) in divisions:
          small, shape = divisions[id(eqn)]
          r = lax.div(np.ones((), small.aval.dtype), read(small))
          out = read(eqn.invars[0]) * (r if shape is None
                                       else lax.broadcast_in_dim(r, **shape))
        elif id(eqn) in swaps:
          dot = swaps[id(eqn)]
          lhs, rhs = dot.invars
          out = dot.primitive.bind(read(rhs), read(lhs),
                                   **_swapped_dot_params(dot))
        else:
          out = eqn.primitive.bind(*[read(v) for v in eqn.invars], **params)
      env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results
                     else [out]))
    return [read(v) for v in jx.outvars]
  fn = lu.wrap_init(f, debug_info=jx.debug_info)
  new, _, consts = pe.trace_to_jaxpr_dynamic(fn, [v.aval for v in jx.invars])
  return transposed(close_jaxpr(_pruned(new), consts))


def _division_by_broadcast(eqn, defs):
  """(values, broadcast params or None) when `eqn` divides a float block
  by at most half as many values broadcast over it (a row statistic): the
  derived kernel divides once per value and multiplies per element instead
  (the quotient within an ulp: transposed divisions are `ct / y`)."""
  if eqn.primitive.name != "div":
    return None
  y, out = eqn.invars[1], eqn.outvars[0]
  if (not isinstance(y, core.Var)
      or not np.issubdtype(y.aval.dtype, np.floating)):
    return None
  small = lambda v: 2 * math.prod(v.aval.shape) <= math.prod(out.aval.shape)
  if small(y):
    return y, None
  b = defs.get(y)
  if (b is not None and b.primitive.name == "broadcast_in_dim"
      and isinstance(b.invars[0], core.Var) and small(b.invars[0])):
    return b.invars[0], b.primitive.get_bind_params(b.params)
  return None


def _transposed_dot(eqn, defs):
  """The `dot_general` equation that `eqn` transposes, when the
  transposition only puts the rhs's free dims before the lhs's (what
  JAX's transpose of a product gives for its rhs: `(c^T x)^T`): a dot of
  the swapped operands gives it, without a transposition of the result."""
  if eqn.primitive.name != "transpose":
    return None
  dot = defs.get(eqn.invars[0])
  if dot is None or dot.primitive.name != "dot_general":
    return None
  (lc, rc), (lb, _) = dot.params["dimension_numbers"]
  if lb:
    return None
  lhs, rhs = dot.invars
  nl, nr = lhs.aval.ndim - len(lc), rhs.aval.ndim - len(rc)
  swapped = tuple(range(nl, nl + nr)) + tuple(range(nl))
  return dot if tuple(eqn.params["permutation"]) == swapped else None


def _swapped_dot_params(dot):
  params = dict(dot.primitive.get_bind_params(dot.params))
  (lc, rc), batch = params["dimension_numbers"]
  params["dimension_numbers"] = ((rc, lc), batch)
  if isinstance(params.get("precision"), tuple):
    params["precision"] = params["precision"][::-1]
  return params


def _pruned(jx):
  """`jx` without the top-level equations (free of effects) whose results
  nothing uses."""
  used = {v for v in jx.outvars if isinstance(v, core.Var)}
  kept = []
  for eqn in reversed(jx.eqns):
    if eqn.effects or any(v in used for v in eqn.outvars):
      kept.append(eqn)
      used |= {v for v in eqn.invars if isinstance(v, core.Var)}
  return jx.replace(eqns=kept[::-1])
