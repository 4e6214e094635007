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
the caller refuses such a kernel. Tags live on jaxpr variables; the last
entry of a tag that scales with the max is the *version* of the max it is
relative to (0: the max the step finds; each `max` and each `cond` whose
branches differ make a new one), so a state that the step does not
rescale where the max grows is caught:

- `("M", v)`: the running max (numerically `M`, or a broadcast of it);
- `("shift", v)`: `y - M`, `y` not reading `M`;
- `("zero_shift", v, w)` and `("alpha", exp, v, w)`: `m_v - m_w` and its
  `exp`, the factor that takes a value from version `v` to `w` (ones);
- `("hom", v)`: carries one factor `exp(. - m_v)`, linearly;
- `("state", i, v)` and `("acc", i, v)`: the running value of state `i`,
  and that value plus a `hom` term (`Context.terms` holds the term).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsl.core.jax_internals import core

BAD = ("bad",)
M_TAG = ("M", 0)      # the running max the step finds
_EXPS = ("exp", "exp2")
_CALLS = ("pjit", "jit", "closed_call")
# Linear maps of one operand: a `hom` value stays `hom`, the max stays
# the max (a broadcast or reshape of it), the rescaling factor stays 1.
_UNARY_LINEAR = ("reduce_sum", "convert_element_type", "broadcast_in_dim",
                 "reshape", "transpose", "squeeze", "expand_dims", "neg",
                 "copy", "copy_p", "reduce_precision")
_KEEPS_SHAPE_TAGS = ("broadcast_in_dim", "reshape", "convert_element_type",
                     "squeeze", "expand_dims", "copy", "copy_p")
# The tags that scale with the max (their last entry: its version).
_SCALED = ("hom", "state", "acc")


def state_tag(i: int) -> tuple:
  """The tag of state `i` as the step finds it."""
  return ("state", i, 0)


@dataclasses.dataclass
class Context:
  mode: str                       # "step" or "epilogue"
  maxes: int = 0                  # `max` equations taken as the max
  exps: set = dataclasses.field(default_factory=set)   # exp prims of hom
  # The sums made while tracing: id(value) -> (state value, added term).
  terms: dict = dataclasses.field(default_factory=dict)
  # The last version of the max handed out (shared with child contexts).
  versions: list = dataclasses.field(default_factory=lambda: [0])

  def child(self) -> Context:
    return Context(self.mode, terms=self.terms, versions=self.versions)

  def new_version(self) -> int:
    self.versions[0] += 1
    return self.versions[0]


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


def _kind(t):
  return None if t is None else t[0]


def _scaled(t) -> bool:
  return _kind(t) in _SCALED


def _versions(tags, ins) -> set | None:
  """The versions of the max that `tags` scale with (zeros scale with
  any), or None when one of them is neither scaled nor zero."""
  out = set()
  for t, x in zip(tags, ins):
    if _scaled(t):
      out.add(t[-1])
    elif not (t is None and is_zero(x)):
      return None
  return out


def _hom(tags, ins):
  """The `hom` tag of a linear combination of `tags`, or None."""
  v = _versions(tags, ins)
  if v is None or len(v) != 1:
    return None
  return ("hom", v.pop())


# ------------------------------------------------------------ rules
#
# rule(ctx, eqn, ins, tags) -> (outs, out_tags), or None: no rule applies
# (bound as it is, tagged BAD when an operand carries a tag).

def _max_rule(ctx, eqn, ins, tags):
  for a, b in ((0, 1), (1, 0)):
    if _kind(tags[a]) == "M" and tags[b] is None:
      ctx.maxes += 1
      return [ins[a]], [("M", ctx.new_version())]
  return None


def _sub_rule(ctx, eqn, ins, tags):
  ka, kb = _kind(tags[0]), _kind(tags[1])
  if ka == kb == "M":
    aval = eqn.outvars[0].aval
    zeros = np.zeros(aval.shape, aval.dtype)
    v, w = tags[0][1], tags[1][1]
    if v == w:
      return [zeros], [None]
    return ([zeros], [("zero_shift", v, w)]) if v < w else None
  if tags[0] is None and kb == "M":
    return _bind(eqn, ins), [("shift", tags[1][1])]
  t = _hom(tags, ins)
  return None if t is None else (_bind(eqn, ins), [t])


def _exp_rule(ctx, eqn, ins, tags):
  name, t = eqn.primitive.name, tags[0]
  if _kind(t) == "shift":
    ctx.exps.add(name)
    return _bind(eqn, ins), [("hom", t[1])]
  if _kind(t) == "zero_shift":
    return _bind(eqn, ins), [("alpha", name, t[1], t[2])]
  return None


def _mul_rule(ctx, eqn, ins, tags):
  for a, b in ((0, 1), (1, 0)):
    ta, tb = tags[a], tags[b]
    if _kind(tb) == "alpha" and _scaled(ta) and ta[-1] == tb[2]:
      # x * exp(m_v - m_w): x scaled with version v now scales with w.
      ctx.exps.add(tb[1])
      return [ins[a]], [ta[:-1] + (tb[3],)]
    if tb is None and _kind(ta) in ("hom", "state"):
      return _bind(eqn, ins), [("hom", ta[-1])]
  return None


def _div_rule(ctx, eqn, ins, tags):
  if tags[1] is None and _kind(tags[0]) in ("hom", "state"):
    return _bind(eqn, ins), [("hom", tags[0][-1])]
  return None


def _dot_rule(ctx, eqn, ins, tags):
  for a, b in ((0, 1), (1, 0)):
    if tags[b] is None and _kind(tags[a]) in ("hom", "state"):
      return _bind(eqn, ins), [("hom", tags[a][-1])]
  return None


def _unary_rule(ctx, eqn, ins, tags):
  t = tags[0]
  if _kind(t) in ("M", "alpha"):
    if eqn.primitive.name in _KEEPS_SHAPE_TAGS:
      return _bind(eqn, ins), [t]
    return None
  if _kind(t) in ("hom", "state"):
    return _bind(eqn, ins), [("hom", t[-1])]
  return None


def _select_rule(ctx, eqn, ins, tags):
  t = _hom(tags[1:], ins[1:]) if tags[0] is None else None
  return None if t is None else (_bind(eqn, ins), [t])


def _add_rule(ctx, eqn, ins, tags):
  for a, b in ((0, 1), (1, 0)):
    t = tags[a]
    if _kind(t) not in ("state", "acc"):
      continue
    v = _versions([tags[b]], [ins[b]])
    if v is None or (v and v != {t[-1]}):
      continue
    if ctx.mode == "epilogue" or not v:
      return [ins[a]], [t]
    out = _bind(eqn, ins)
    base, term = ((ins[a], ins[b]) if t[0] == "state" else
                  (ctx.terms[id(ins[a])][0],
                   ctx.terms[id(ins[a])][1] + ins[b]))
    ctx.terms[id(out[0])] = (base, term)
    return out, [("acc", t[1], t[-1])]
  t = _hom(tags, ins)
  return None if t is None else (_bind(eqn, ins), [t])


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


def _branch_version(tags) -> int | None:
  """The one version of the max a branch's results scale with, None when
  none does; BAD when they mix versions (a state not rescaled where the
  max grew)."""
  v = {t[-1] for t in tags if _scaled(t) or _kind(t) == "M"}
  return v.pop() if len(v) == 1 else (None if not v else BAD)


def _merged(tags, constants, version):
  """The tag of a cond output from its branches' tags (at `version` of
  the max), and how the cond returns it: "value", "max" (the max itself,
  not returned) or "term" (the state is returned unchanged and its added
  term separately)."""
  kinds = {_kind(t) for t in tags}
  zero = [t is None and c is not None and not np.any(c)
          for t, c in zip(tags, constants)]
  if "M" in kinds and all(_kind(t) == "M" or (t is None and c is not None)
                          for t, c in zip(tags, constants)):
    return ("M", version), "max"   # the max, or its initial value
  states = {t[1] for t in tags if _kind(t) in ("state", "acc")}
  if len(states) == 1 and all(_kind(t) in ("state", "acc") or z
                              for t, z in zip(tags, zero)):
    # (A state reset to zeros in a branch: the first step's init.)
    kind = "acc" if "acc" in kinds else "state"
    return (kind, states.pop(), version), ("term" if kind == "acc"
                                           else "value")
  if kinds <= {"hom", None} and all(_kind(t) == "hom" or z
                                    for t, z in zip(tags, zero)):
    return ("hom", version), "value"
  if kinds == {None}:
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
  versions = {_branch_version(ts) for ts in per_branch} - {None}
  version = (versions.pop() if len(versions) == 1 and BAD not in versions
             else ctx.new_version())
  merged = []
  for k, ts in enumerate(zip(*per_branch)):
    t, how = _merged(list(ts), [_constant(b, k) for b in branches], version)
    if BAD in versions and t is not None:
      t, how = BAD, "value"
    merged.append((t, how))
  max_value = next((x for x, t in zip(ops, op_tags) if _kind(t) == "M"),
                   None)
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


def _rebuilt_cond(ctx, index, branches, ops, op_tags, merged, max_value):
  """Binds the cond again with each branch rewritten: the max is not
  returned, a state's added term is returned in place of the sum."""
  state_ops = {t[1]: x for x, t in zip(ops, op_tags)
               if _kind(t) == "state"}

  def branch_fn(b):
    def f(*xs):
      outs, ts = evaluate(ctx.child(), b.jaxpr, b.consts, xs, op_tags)
      res = []
      for x, t, (mt, how) in zip(outs, ts, merged):
        if how == "max":
          continue
        if how == "term":
          res.append(ctx.terms[id(x)][1] if _kind(t) == "acc"
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
        mt = ("state",) + mt[1:]
      else:
        x = base + term
        ctx.terms[id(x)] = (base, term)
        values.append(x)
    else:
      values.append(next(outs))
    tags.append(mt)
  return values, tags
