"""Dots of a derived kernel that contract the leading dim of a tile the
kernel computes, given that tile computed transposed.

The transposition of `p @ v` in `v` is `p^T @ ct`: a dot that contracts
`p`'s leading dim. On a CPU, XLA then writes `p` (or what is computed from
it) transposed in the fusion that makes it, a strided store of the whole
tile per step; a hand-written kernel computes the tile transposed in the
first place (flash attention's dK/dV kernel works on `s^T = k q^T`). Where
the contracted tile is made by elementwise operations from dots,
broadcasts of rows or scalars and iotas, `transposed` rewrites the dot to
contract the tile computed transposed: a dot's transpose is the dot with
its operands swapped, a broadcast's the broadcast along the other dim,
an iota's the iota along the other dim; nothing is transposed in memory.
The tile as it was stays for its other uses (and goes where it has none).
"""
from __future__ import annotations

import jax
import numpy as np
from jax import lax

from dsl.core.jax_internals import (ClosedJaxpr, close_jaxpr, core,
                                    linear_util as lu,
                                    partial_eval as pe, source_info_util)

# Elementwise primitives: the transpose of the result is the result on the
# transposed operands.
_ELEMENTWISE = frozenset({
    "add", "add_any", "sub", "mul", "div", "max", "min", "neg", "exp",
    "exp2", "log", "log1p", "tanh", "logistic", "abs", "sign", "sqrt",
    "rsqrt", "integer_pow", "pow", "select_n", "convert_element_type",
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
    "reduce_precision"})


def _leading_contraction(eqn, t) -> str | None:
  """How to rewrite `eqn` when it is a 2-D dot without batch dims whose
  lhs contracts its leading dim: "lhs" (the lhs made transposed), "swap"
  (the rhs, contracting its leading dim too, made transposed: the dot's
  transpose computed, with the operands swapped), or None."""
  if eqn.primitive.name != "dot_general":
    return None
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  a, b = eqn.invars
  if (lb or rb or tuple(lc) != (0,) or isinstance(a, core.Literal)
      or a.aval.ndim != 2 or b.aval.ndim != 2):
    return None
  if t.can(a):
    return "lhs"
  if tuple(rc) == (0,) and t.can(b):
    return "swap"
  return None


class _Transposer:
  """Which 2-D values of a jaxpr can be made transposed from dots (`can`),
  and making them (`make`) while the jaxpr is traced again."""

  def __init__(self, jx: core.Jaxpr, consts=(), given=None):
    self.defs = {v: e for e in jx.eqns for v in e.outvars}
    # Inputs whose transposes are given: var -> (reach, transposed value);
    # a constant's is its transpose, made now.
    self.given = dict(given or {})
    self.given.update({v: ("free", np.transpose(np.asarray(x)))
                       for v, x in zip(jx.constvars, consts)
                       if np.ndim(x) == 2 and not isinstance(x, core.Tracer)})
    self.known: dict = {v: r for v, (r, _) in self.given.items()}

  def can(self, v) -> bool:
    """Whether `v` can be made transposed with at least one dot and no
    transposition in memory."""
    return self._reach(v) == "dot"

  def _reach(self, v):
    """"dot" (made from a dot), "free" (rows, scalars, iotas: no dot) or
    None (not transposable)."""
    if isinstance(v, core.Literal) or v.aval.ndim == 0:
      return "free"
    if v in self.known:
      return self.known[v]
    self.known[v] = None
    e = self.defs.get(v)
    got = None
    if e is None or v.aval.ndim != 2 or e.effects:
      got = None
    elif e.primitive.name == "dot_general":
      got = "dot" if not e.params["dimension_numbers"][1][0] else None
    elif e.primitive.name == "iota":
      got = "free"
    elif e.primitive.name == "broadcast_in_dim":
      x = e.invars[0]
      got = ("free" if isinstance(x, core.Literal) or x.aval.ndim < 2
             else self._reach(x))
    elif e.primitive.name in _ELEMENTWISE:
      found = [self._reach(x) for x in e.invars]
      got = (None if None in found else
             "dot" if "dot" in found else "free")
    self.known[v] = got
    return got

  def make(self, v, read, memo):
    """`v` transposed, from the values `read` gives (traced)."""
    if isinstance(v, core.Literal):
      return v.val
    if v.aval.ndim == 0:
      return read(v)
    if v in self.given:
      return self.given[v][1]
    if v in memo:
      return memo[v]
    e = self.defs[v]
    p = e.primitive.get_bind_params(e.params)
    name = e.primitive.name
    if name == "dot_general":
      (lc, rc), _ = p["dimension_numbers"]
      a, b = (read(x) for x in e.invars)
      out = e.primitive.bind(b, a, **dict(p, dimension_numbers=(
          (tuple(rc), tuple(lc)), ((), ()))))
    elif name == "iota":
      out = lax.broadcasted_iota(p["dtype"], p["shape"][::-1],
                                 1 - p["dimension"])
    elif name == "broadcast_in_dim":
      x = e.invars[0]
      shape = p["shape"][::-1]
      if isinstance(x, core.Literal) or x.aval.ndim == 0:
        out = lax.broadcast_in_dim(read(x), shape, ())
      elif x.aval.ndim == 1:
        out = lax.broadcast_in_dim(read(x), shape,
                                   (1 - p["broadcast_dimensions"][0],))
      else:
        out = lax.broadcast_in_dim(self.make(x, read, memo), shape,
                                   tuple(p["broadcast_dimensions"]))
    else:
      ins = [self.make(x, read, memo) if not _scalar(x) else read(x)
             for x in e.invars]
      out = e.primitive.bind(*ins, **p)
    memo[v] = out
    return out


def _scalar(x) -> bool:
  return isinstance(x, core.Literal) or x.aval.ndim == 0


def _has_leading_contraction(jx: core.Jaxpr) -> bool:
  for e in jx.eqns:
    if e.primitive.name == "dot_general":
      (lc, _), (lb, _) = e.params["dimension_numbers"]
      if not lb and tuple(lc) == (0,):
        return True
    if e.primitive.name == "cond" and any(
        _has_leading_contraction(b.jaxpr) for b in e.params["branches"]):
      return True
  return False


def transposed(closed: ClosedJaxpr) -> ClosedJaxpr:
  """`closed` with its dots that contract the leading dim of a tile made
  from dots computed on that tile transposed (the module docstring), in
  the branches of its `cond`s too; `closed` itself when it has none."""
  jx = closed.jaxpr
  if not _has_leading_contraction(jx):
    return closed
  t = _Transposer(jx, closed.consts)
  if not (any(_leading_contraction(e, t) for e in jx.eqns)
          or any(_rewritten_cond(e) for e in jx.eqns)):
    return closed
  fn = lu.wrap_init(lambda *args: _evaluate(jx, closed.consts, args, {}),
                    debug_info=jx.debug_info)
  new, _, consts = pe.trace_to_jaxpr_dynamic(fn, [v.aval for v in jx.invars])
  new, _ = pe.dce_jaxpr(new, [True] * len(new.outvars), instantiate=True)
  return close_jaxpr(new, consts)


def _rewritten_cond(eqn) -> bool:
  """Whether `eqn` is a `cond` (of values) whose branches contract a
  leading dim: it is bound again with its branches rewritten."""
  return (eqn.primitive.name == "cond" and not eqn.effects and any(
      _has_leading_contraction(b.jaxpr) for b in eqn.params["branches"]))


def _paired(jx: core.Jaxpr) -> dict:
  """id(cond) -> the cond right after it on the same index, whose
  branches contract a leading dim: JAX's linearization splits a
  `pl.when` into a primal and a tangent `cond`, so the tiles and the dots
  that contract them are in two `cond`s, run here as one."""
  pairs = {}
  for e, nxt in zip(jx.eqns, jx.eqns[1:]):
    if (e.primitive.name == "cond" and not e.effects
        and _rewritten_cond(nxt) and e.invars[0] is nxt.invars[0]
        and id(e) not in {id(x) for x in pairs.values()}):
      pairs[id(e)] = nxt
  return pairs


def _evaluate(jx, consts, args, given):
  """`jx`'s results on `args`, traced with its dots that contract a
  tile's leading dim rewritten; `given`: the transposes of some inputs
  (var -> (reach, value))."""
  t = _Transposer(jx, consts, given)
  chosen = {id(e): how for e in jx.eqns
            if (how := _leading_contraction(e, t)) is not None}
  pairs = _paired(jx)
  env = dict(zip(jx.constvars, consts))
  env.update(zip(jx.invars, args))
  read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
  memo: dict = {}
  swapped: dict = {}     # id(a swapped dot's result) -> its transpose
  later: dict = {}       # id(the second cond of a pair) -> its results
  for eqn in jx.eqns:
    params = eqn.primitive.get_bind_params(eqn.params)
    ins = [read(v) for v in eqn.invars]
    with source_info_util.user_context(eqn.source_info.traceback):
      if id(eqn) in later:
        out = later[id(eqn)]
      elif id(eqn) in pairs:
        out, later[id(pairs[id(eqn)])] = _merged_cond(
            eqn, pairs[id(eqn)], t, read, memo)
      elif _rewritten_cond(eqn):
        out = _cond(eqn.invars[0], eqn.invars[1:], params["branches"], t,
                    read, memo)
      elif id(eqn) in chosen:
        out = _dot_on_transposed(eqn, chosen[id(eqn)], t, read, memo,
                                 swapped)
      elif (eqn.primitive.name == "transpose" and id(ins[0]) in swapped
            and tuple(params["permutation"]) == (1, 0)):
        out = swapped[id(ins[0])]
      else:
        out = eqn.primitive.bind(*ins, **params)
    env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results
                   else [out]))
  return [read(v) for v in jx.outvars]


def _cond(index, operands, branches, t, read, memo):
  """A `cond` whose branches are rewritten, each given the transposes of
  the 2-D operands that can be made transposed outside it."""
  moved = [k for k, v in enumerate(operands) if isinstance(v, core.Var)
           and v.aval.ndim == 2 and t._reach(v) is not None]
  ops = [read(v) for v in operands]
  tops = [t.make(operands[k], read, memo) for k in moved]
  reach = [t._reach(operands[k]) for k in moved]
  n = len(ops)

  def branch(b):
    def run(*xs):
      given = {b.jaxpr.invars[k]: (r, x)
               for k, r, x in zip(moved, reach, xs[n:])}
      return _evaluate(b.jaxpr, b.consts, xs[:n], given)
    return run
  return lax.switch(read(index), [branch(b) for b in branches], *ops, *tops)


def _merged_cond(first, second, t, read, memo):
  """The results of two `cond`s on one index, as one `cond` whose
  branches run the first's branch, then the second's."""
  made = {v: k for k, v in enumerate(first.outvars)}
  extra = [v for v in second.invars[1:] if v not in made]
  n1 = len(first.invars) - 1

  def joined(b1, b2):
    def run(*ops):
      outs1 = core.eval_jaxpr(b1.jaxpr, b1.consts, *ops[:n1])
      given = dict(zip(extra, ops[n1:]))
      return list(outs1) + list(core.eval_jaxpr(
          b2.jaxpr, b2.consts, *[outs1[made[v]] if v in made else given[v]
                                 for v in second.invars[1:]]))
    return jax.make_jaxpr(run)(*[v.aval for v in first.invars[1:] + extra])
  branches = [joined(b1, b2) for b1, b2 in zip(first.params["branches"],
                                               second.params["branches"])]
  outs = _cond(first.invars[0], list(first.invars[1:]) + extra, branches, t,
               read, memo)
  n = len(first.outvars)
  return list(outs[:n]), list(outs[n:])


def _dot_on_transposed(eqn, how, t, read, memo, swapped):
  """The dot `eqn`, whose lhs contracts its leading dim, as a dot whose
  contracted operand is made transposed (`how`: `_leading_contraction`)."""
  p = eqn.primitive.get_bind_params(eqn.params)
  (_, rc), _ = p["dimension_numbers"]
  a, b = eqn.invars
  if how == "lhs":
    return eqn.primitive.bind(t.make(a, read, memo), read(b), **dict(
        p, dimension_numbers=(((1,), tuple(rc)), ((), ()))))
  inner = eqn.primitive.bind(t.make(b, read, memo), read(a), **dict(
      p, dimension_numbers=(((1,), (0,)), ((), ()))))
  out = lax.transpose(inner, (1, 0))
  swapped[id(out)] = inner
  return out
