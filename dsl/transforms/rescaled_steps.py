"""One step of a rescaled reduction, re-evaluated at the reduction's final
running max.

A *rescaled reduction* keeps a running max `m` and states `x` that it
rescales whenever the max grows (the online softmax / logsumexp family):

    m' = max(m, r)           r not reading the state
    x' = x * exp(m - m') + e(m')

where `e(m')` is a sum of terms each carrying one factor `exp(y - m')`
(`p = exp(s - m')`, `rowsum(p)`, `p @ v`). With `M`, the final max, every
`exp(y - m')` is `exp(y - M) * exp(M - m')`, the rescaling factors
telescope, and the final states are plain sums: `x_final = sum_j e_j(M)`.

`evaluate` runs a step's jaxpr with every value tagged by what it is in
that picture, and rewrites it at `M`: the running max (and every `max` of
it with a value that does not read it) is `M`, `exp(M - M)` is 1, so a
step becomes `x' = x + e(M)` (`"step"` mode), or, for the epilogue that
reads the final states, `x' = x` (`"epilogue"` mode: the update dropped).
A value that mixes `M` or a state in any other way is tagged `BAD`;
the caller refuses such a kernel. Tags live on jaxpr variables:

- `("M",)`: the running max (numerically `M`, or a broadcast of it);
- `("shift",)`: `y - M`, `y` not reading `M`;
- `("zero_shift",)` and `("alpha", exp)`: `M - M` and its `exp`, ones;
- `("hom",)`: carries one factor `exp(. - M)`, linearly;
- `("state", i)` and `("acc", i)`: the running value of state `i`, and
  that value plus a `hom` term (`Context.terms` holds the term).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsl.core.jax_internals import core

BAD = ("bad",)
M_TAG = ("M",)
HOM = ("hom",)
_EXPS = ("exp", "exp2")
_CALLS = ("pjit", "jit", "closed_call")
# Linear maps of one operand: a `hom` value stays `hom`, the max stays
# the max (a broadcast or reshape of it), the rescaling factor stays 1.
_UNARY_LINEAR = ("reduce_sum", "convert_element_type", "broadcast_in_dim",
                 "reshape", "transpose", "squeeze", "expand_dims", "neg",
                 "copy", "copy_p", "reduce_precision")
_KEEPS_SHAPE_TAGS = ("broadcast_in_dim", "reshape", "convert_element_type",
                     "squeeze", "expand_dims", "copy", "copy_p")


@dataclasses.dataclass
class Context:
  mode: str                       # "step" or "epilogue"
  maxes: int = 0                  # `max` equations taken as the max
  exps: set = dataclasses.field(default_factory=set)   # exp prims of hom
  # The sums made while tracing: id(value) -> (state value, added term).
  terms: dict = dataclasses.field(default_factory=dict)

  def child(self) -> Context:
    return Context(self.mode, terms=self.terms)


def _concrete(x) -> bool:
  return not isinstance(x, core.Tracer)


def is_zero(x) -> bool:
  return _concrete(x) and not np.any(np.asarray(x))


def _bind(eqn, ins):
  params = eqn.primitive.get_bind_params(eqn.params)
  if ins and all(_concrete(x) for x in ins) and not eqn.effects:
    # Folded at trace time, kept as numpy (a jax array would be traced
    # again by whatever inspects it under an enclosing trace). An `iota`
    # stays an iota: a constant array would be loaded from memory.
    with jax.ensure_compile_time_eval():
      out = eqn.primitive.bind(*ins, **params)
    out = ([np.asarray(o) for o in out] if eqn.primitive.multiple_results
           else np.asarray(out))
  else:
    out = eqn.primitive.bind(*ins, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


def _hom_like(t, x) -> bool:
  """A value that may take part in a `hom` sum: `hom` itself or zeros."""
  return t == HOM or (t is None and is_zero(x))


# ------------------------------------------------------------ rules
#
# rule(ctx, eqn, ins, tags) -> (outs, out_tags), or None: no rule applies
# (bound as it is, tagged BAD when an operand carries a tag).

def _max_rule(ctx, eqn, ins, tags):
  for a, b in ((0, 1), (1, 0)):
    if tags[a] == M_TAG and tags[b] is None:
      ctx.maxes += 1
      return [ins[a]], [M_TAG]
  return None


def _sub_rule(ctx, eqn, ins, tags):
  if tags == [M_TAG, M_TAG]:
    aval = eqn.outvars[0].aval
    return [np.zeros(aval.shape, aval.dtype)], [("zero_shift",)]
  if tags[0] is None and tags[1] == M_TAG:
    return _bind(eqn, ins), [("shift",)]
  if all(_hom_like(t, x) for t, x in zip(tags, ins)):
    return _bind(eqn, ins), [HOM]
  return None


def _exp_rule(ctx, eqn, ins, tags):
  name = eqn.primitive.name
  if tags[0] == ("shift",):
    ctx.exps.add(name)
    return _bind(eqn, ins), [HOM]
  if tags[0] == ("zero_shift",):
    return _bind(eqn, ins), [("alpha", name)]
  return None


def _is_alpha(t) -> bool:
  return t is not None and t[0] == "alpha"


def _mul_rule(ctx, eqn, ins, tags):
  for a, b in ((0, 1), (1, 0)):
    if _is_alpha(tags[b]) and tags[a] is not None and tags[a][0] in (
        "state", "acc", "hom"):
      ctx.exps.add(tags[b][1])
      return [ins[a]], [tags[a]]
    if tags[b] is None and tags[a] is not None and tags[a][0] in (
        "hom", "state"):
      return _bind(eqn, ins), [HOM]
  return None


def _div_rule(ctx, eqn, ins, tags):
  if tags[1] is None and tags[0] is not None and tags[0][0] in ("hom",
                                                                "state"):
    return _bind(eqn, ins), [HOM]
  return None


def _dot_rule(ctx, eqn, ins, tags):
  for a, b in ((0, 1), (1, 0)):
    if tags[b] is None and tags[a] is not None and tags[a][0] in (
        "hom", "state"):
      return _bind(eqn, ins), [HOM]
  return None


def _unary_rule(ctx, eqn, ins, tags):
  t = tags[0]
  if t == M_TAG or _is_alpha(t):
    if eqn.primitive.name in _KEEPS_SHAPE_TAGS:
      return _bind(eqn, ins), [t]
    return None
  if t is not None and t[0] in ("hom", "state"):
    return _bind(eqn, ins), [HOM]
  return None


def _select_rule(ctx, eqn, ins, tags):
  if tags[0] is None and all(_hom_like(t, x) for t, x in
                             zip(tags[1:], ins[1:])):
    return _bind(eqn, ins), [HOM]
  return None


def _add_rule(ctx, eqn, ins, tags):
  for a, b in ((0, 1), (1, 0)):
    t = tags[a]
    if t is None or t[0] not in ("state", "acc") or not _hom_like(
        tags[b], ins[b]):
      continue
    if ctx.mode == "epilogue" or (tags[b] is None and is_zero(ins[b])):
      return [ins[a]], [t]
    out = _bind(eqn, ins)
    base, term = ((ins[a], ins[b]) if t[0] == "state" else
                  (ctx.terms[id(ins[a])][0],
                   ctx.terms[id(ins[a])][1] + ins[b]))
    ctx.terms[id(out[0])] = (base, term)
    return out, [("acc", t[1])]
  if all(_hom_like(t, x) for t, x in zip(tags, ins)):
    return _bind(eqn, ins), [HOM]
  return None


RULES = {"max": _max_rule, "sub": _sub_rule, "mul": _mul_rule,
         "div": _div_rule, "dot_general": _dot_rule,
         "select_n": _select_rule, "add": _add_rule, "add_any": _add_rule,
         **{p: _exp_rule for p in _EXPS},
         **{p: _unary_rule for p in _UNARY_LINEAR}}


# ------------------------------------------------------------ evaluation

def evaluate(ctx: Context, jaxpr: core.Jaxpr, consts, args, arg_tags):
  """(values, tags) of `jaxpr`'s outputs, rewritten at the final max (the
  module docstring); `arg_tags`: the inputs' tags."""
  env, tag = {}, {}
  for v, x in zip(jaxpr.constvars, consts):
    env[v], tag[v] = x, None
  for v, x, t in zip(jaxpr.invars, args, arg_tags):
    env[v], tag[v] = x, t
  read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
  tag_of = lambda v: None if isinstance(v, core.Literal) else tag[v]
  for eqn in jaxpr.eqns:
    ins, tags = [read(v) for v in eqn.invars], [tag_of(v) for v in eqn.invars]
    outs, out_tags = _equation(ctx, eqn, ins, tags)
    for v, x, t in zip(eqn.outvars, outs, out_tags):
      env[v], tag[v] = x, t
  return [read(v) for v in jaxpr.outvars], [tag_of(v) for v in jaxpr.outvars]


def _equation(ctx, eqn, ins, tags):
  name = eqn.primitive.name
  if name == "cond":
    return _cond(ctx, eqn, ins, tags)
  if name in _CALLS:
    called = eqn.params["jaxpr"]
    return evaluate(ctx, called.jaxpr, called.consts, ins, tags)
  if all(t is None for t in tags):
    return _bind(eqn, ins), [None] * len(eqn.outvars)
  rule = RULES.get(name)
  got = rule(ctx, eqn, ins, tags) if rule is not None else None
  if got is None:
    return _bind(eqn, ins), [BAD] * len(eqn.outvars)
  return got


def _branch_tags(ctx, branch, ins, tags):
  """The tags of a branch's outputs (traced on its own, then dropped)."""
  probe = ctx.child()
  got = []

  def f(*xs):
    outs, ts = evaluate(probe, branch.jaxpr, branch.consts, xs, tags)
    got.append(ts)
    return outs
  jax.make_jaxpr(f)(*[jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
                      for x in ins])
  ctx.maxes += probe.maxes
  ctx.exps |= probe.exps
  return got[0]


def _merged(tags, constants):
  """The tag of a cond output from its branches' tags, and how the cond
  returns it: "value", "max" (the max itself, not returned) or "term" (the
  state is returned unchanged and its added term separately)."""
  if all(t == M_TAG or (t is None and c is not None)
         for t, c in zip(tags, constants)) and M_TAG in tags:
    return M_TAG, "max"     # the max, or its initial value (a constant)
  states = {t[1] for t in tags if t is not None and t[0] in ("state", "acc")}
  if len(states) == 1 and all(t is not None and t[0] in ("state", "acc")
                              for t in tags):
    i = states.pop()
    if any(t[0] == "acc" for t in tags):
      return ("acc", i), "term"
    return ("state", i), "value"
  if all(t == HOM for t in tags):
    return HOM, "value"
  if all(t is None for t in tags):
    return None, "value"
  return BAD, "value"


def _cond(ctx, eqn, ins, tags):
  index, ops, op_tags = ins[0], ins[1:], tags[1:]
  branches = eqn.params["branches"]
  if _concrete(index):
    b = branches[int(np.clip(int(index), 0, len(branches) - 1))]
    return evaluate(ctx, b.jaxpr, b.consts, ops, op_tags)
  if tags[0] is not None:
    return _bind(eqn, ins), [BAD] * len(eqn.outvars)
  per_branch = [_branch_tags(ctx, b, ops, op_tags) for b in branches]
  merged = []
  for k, ts in enumerate(zip(*per_branch)):
    constants = [_constant(b, k) for b in branches]
    t, how = _merged(list(ts), constants)
    # A state reset to zeros in one branch (the first step's init) and
    # kept in another is the state's running value.
    zeros = [c is not None and not np.any(c) for c in constants]
    if t == BAD and _state_or_zero(ts, zeros):
      t, how = ("state", next(x[1] for x in ts if x is not None)), "value"
    merged.append((t, how))
  max_value = next((x for x, t in zip(ops, op_tags) if t == M_TAG), None)
  if max_value is None:     # a max made in the branches, not passed in
    merged = [(BAD, "value") if how == "max" else (t, how)
              for t, how in merged]
  return _rebuilt_cond(ctx, index, branches, ops, op_tags, merged, max_value)


def _constant(branch, k):
  """The constant output `k` of `branch` is filled with (a literal, or a
  broadcast of one), or None."""
  v = branch.jaxpr.outvars[k]
  if isinstance(v, core.Literal):
    return np.asarray(v.val)
  defs = {o: e for e in branch.jaxpr.eqns for o in e.outvars}
  e = defs.get(v)
  if (e is not None and e.primitive.name == "broadcast_in_dim"
      and isinstance(e.invars[0], core.Literal)):
    return np.asarray(e.invars[0].val)
  return None


def _state_or_zero(ts, zeros) -> bool:
  states = {t[1] for t in ts if t is not None and t[0] == "state"}
  return len(states) == 1 and all(
      (t is not None and t[0] == "state") or (t is None and z)
      for t, z in zip(ts, zeros))


def _rebuilt_cond(ctx, index, branches, ops, op_tags, merged, max_value):
  """Binds the cond again with each branch rewritten: the max is not
  returned, a state's added term is returned in place of the sum."""
  state_ops = {t[1]: x for x, t in zip(ops, op_tags)
               if t is not None and t[0] == "state"}

  def branch_fn(b):
    def f(*xs):
      outs, ts = evaluate(ctx.child(), b.jaxpr, b.consts, xs, op_tags)
      res = []
      for x, t, (mt, how) in zip(outs, ts, merged):
        if how == "max":
          continue
        if how == "term":
          res.append(ctx.terms[id(x)][1] if t[0] == "acc"
                     else jnp.zeros(jnp.shape(x), jnp.result_type(x)))
        else:
          res.append(x)
      return [jnp.asarray(r) for r in res]
    return f
  outs = iter(lax.switch(index, [branch_fn(b) for b in branches], *ops))
  values, tags = [], []
  for mt, how in merged:
    if how == "max":
      values.append(max_value)
    elif how == "term":
      term = next(outs)
      base = state_ops.get(mt[1])
      if base is None:
        values.append(term)
        mt = BAD
      elif ctx.mode == "epilogue":
        values.append(base)
        mt = ("state", mt[1])
      else:
        x = base + term
        ctx.terms[id(x)] = (base, term)
        values.append(x)
    else:
      values.append(next(outs))
    tags.append(mt)
  return values, tags
