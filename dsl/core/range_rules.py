"""The range analysis's rules: what each primitive does to integer intervals.

`RANGE_RULES` is a `RuleTable` keyed by primitive, walked by
`dsl.core.jaxpr_walk.walk_jaxpr` with the host of `dsl.core.ranges`. A rule gets the
intervals of its operands (`dsl.core.intervals.Interval`; None for a value that
is not an integer, or unknown) and returns its results' intervals. A
primitive without a rule gives every integer result its dtype's whole range:
the analysis never fails on what it does not know, it only proves less.

Control flow is analysed, not unrolled: a branch of `cond` only when its
index can select it; a loop's counter (a carry that each step adds a
constant to: what `fori_loop` makes) gets the interval of its trip; other
carries iterate to a fixed point, widened to their dtype's range when they
keep growing.
"""
from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from dsl.core.jax_internals import ad_checkpoint, core, pjit, state_primitives

from dsl.core import intervals as iv
from dsl.core import mask_bounds
from dsl.core import primitives as dsl_primitives
from dsl.core import ref_ops
from dsl.core.intervals import Interval, fit
from dsl.core.jaxpr_walk import CALL_PRIMITIVES, RuleTable, call_body
from dsl.core.normalize import scan_layout
from dsl.core.operand_layout import eqn_ref_operands, ref_operands


class RangeTable(RuleTable):
  """A rule table whose unknown primitives get `top_rule`."""

  def lookup(self, key):
    return super().lookup(key) or top_rule


RANGE_RULES = RangeTable("the range analysis")


def top_rule(ctx, *args, **params):
  """Every result anywhere in its dtype's range (and the refs among the
  operands escape the analysis)."""
  ctx.escape(args)
  return [ctx.top(k) for k in range(len(ctx.eqn.outvars))]


# ------------------------------------------------------------ arithmetic

def _binary(fn):
  def rule(ctx, a, b, **params):
    if a is None or b is None:
      return ctx.top()
    return fit(fn(a, b), ctx.dtype())
  return rule


for _p, _fn in ((lax.add_p, operator.add),
                (lax.mul_p, operator.mul), (lax.div_p, iv.div),
                (lax.rem_p, iv.rem), (lax.max_p, iv.maximum),
                (lax.min_p, iv.minimum), (lax.and_p, iv.bitwise_and),
                (lax.or_p, iv.bitwise_or)):
  RANGE_RULES.register(_p)(_binary(_fn))

@RANGE_RULES.register(lax.sub_p)
def _sub(ctx, a, b):
  """`a - b`, narrowed by what relates `a` to `b`: `a = min(x, b + k)`
  (`k` a literal, `b + k` not wrapping) gives `a - b <= k` whatever `x`
  is, and `a = max(x, b + k)` gives `a - b >= k`; an interval of `a` and
  one of `b` alone cannot see it (`cdiv(min(n, s + p) - s, p)`, the trip
  count of a loop over one split of `p` items starting at `s`, is at
  most 1)."""
  if a is None or b is None:
    return ctx.top()
  plain = a - b
  found = _relation(ctx, *ctx.eqn.invars, b)
  if found is not None:
    above, k = found
    lo, hi = (plain.lo, min(plain.hi, k)) if above else (max(plain.lo, k),
                                                         plain.hi)
    if lo <= hi:
      plain = Interval(lo, hi)
  return fit(plain, ctx.dtype())


def _relation(ctx, a_var, b_var, b: Interval) -> tuple[bool, int] | None:
  """(True, k) when `a_var = min(x, b_var + k)`, (False, k) when it is
  `max(x, b_var + k)`, with `b_var + k` not wrapping around."""
  if not isinstance(a_var, core.Var) or not isinstance(b_var, core.Var):
    return None
  _, eqn = ctx.definition(a_var)
  if eqn is None or eqn.primitive not in (lax.min_p, lax.max_p):
    return None
  root, _ = ctx.definition(b_var)
  for y in eqn.invars:
    k = _offset_from(ctx, y, root)
    if k is not None and fit(b + Interval.const(k), ctx.dtype()) == \
        b + Interval.const(k):
      return eqn.primitive is lax.min_p, k
  return None


def _offset_from(ctx, y, root) -> int | None:
  """k when `y` is `root + k` (or `root - k`) for a literal k, 0 when it is
  `root` itself."""
  if not isinstance(y, core.Var):
    return None
  y_root, eqn = ctx.definition(y)
  if y_root is root:
    return 0
  if eqn is None or eqn.primitive not in (lax.add_p, lax.sub_p):
    return None
  p, q = eqn.invars
  orders = [(p, q)] + ([(q, p)] if eqn.primitive is lax.add_p else [])
  for var, lit in orders:
    k = _literal_int(lit)
    if isinstance(var, core.Var) and k is not None and \
        ctx.definition(var)[0] is root:
      return k if eqn.primitive is lax.add_p else -k
  return None


for _p in (lax.lt_p, lax.le_p, lax.gt_p, lax.ge_p, lax.eq_p, lax.ne_p):
  RANGE_RULES.register(_p)(_binary(functools.partial(iv.compare, _p.name)))


def _unary(fn):
  def rule(ctx, a, **params):
    return ctx.top() if a is None else fit(fn(a), ctx.dtype())
  return rule


RANGE_RULES.register(lax.neg_p)(_unary(operator.neg))
RANGE_RULES.register(lax.abs_p)(_unary(iv.absolute))
RANGE_RULES.register(lax.sign_p)(_unary(iv.sign))


@RANGE_RULES.register(lax.not_p)
def _not(ctx, a):
  dtype = np.dtype(ctx.dtype())
  if a is None:
    return ctx.top()
  if dtype == np.bool_:
    return Interval(1 - a.hi, 1 - a.lo)
  if np.issubdtype(dtype, np.unsignedinteger):
    top = iv.dtype_range(dtype).hi
    return Interval(top - a.hi, top - a.lo)
  return Interval(-a.hi - 1, -a.lo - 1)


def _bits(ctx) -> int:
  return np.dtype(ctx.dtype()).itemsize * 8


@RANGE_RULES.register(lax.shift_left_p)
def _shift_left(ctx, a, k):
  if a is None or k is None:
    return ctx.top()
  return fit(iv.shift_left(a, k, _bits(ctx)), ctx.dtype())


@RANGE_RULES.register(lax.shift_right_arithmetic_p,
                      lax.shift_right_logical_p)
def _shift_right(ctx, a, k):
  logical = ctx.primitive is lax.shift_right_logical_p
  if a is None or k is None or (logical and a.lo < 0):
    return ctx.top()
  return fit(iv.shift_right(a, k, _bits(ctx)), ctx.dtype())


@RANGE_RULES.register(lax.integer_pow_p)
def _integer_pow(ctx, a, *, y):
  if a is None or y < 0:
    return ctx.top()
  corners = [a.lo, a.hi] + ([0] if a.lo < 0 < a.hi else [])
  return fit(Interval.hull(c ** y for c in corners), ctx.dtype())


@RANGE_RULES.register(lax.clamp_p)
def _clamp(ctx, lo, x, hi):
  if lo is None or x is None or hi is None:
    return ctx.top()
  return iv.minimum(iv.maximum(x, lo), hi)


@RANGE_RULES.register(lax.select_n_p)
def _select_n(ctx, which, *cases):
  if which is None:
    return iv.join_all(cases) or ctx.top()
  return iv.select(which, list(cases)) or ctx.top()


@RANGE_RULES.register(lax.convert_element_type_p)
def _convert(ctx, x, **params):
  return fit(x, ctx.dtype()) if x is not None else ctx.top()


# ------------------------------------------------------ shapes, reductions

_SAME_VALUES = (
    lax.broadcast_in_dim_p, lax.reshape_p, lax.squeeze_p, lax.transpose_p,
    lax.rev_p, lax.slice_p, lax.reduce_max_p, lax.reduce_min_p,
    lax.expand_dims_p if hasattr(lax, "expand_dims_p") else None,
    lax.copy_p, lax.dynamic_slice_p, lax.cummax_p,
    state_primitives.broadcast_to_p,
    lax.cummin_p, dsl_primitives.multiple_of_p,
    dsl_primitives.max_contiguous_p, ad_checkpoint.name_p)


@RANGE_RULES.register(*_SAME_VALUES)
def _same_values(ctx, x, *rest, **params):
  """Results whose elements are some of the first operand's elements."""
  if x is None or ctx.eqn.invars[0].aval.size == 0:
    return ctx.top()
  return x


@RANGE_RULES.register(lax.concatenate_p, lax.pad_p,
                      lax.dynamic_update_slice_p)
def _hull_of_operands(ctx, *xs, **params):
  """concatenate (all operands), pad (operand and padding value),
  dynamic_update_slice (operand and update; the starts are not values)."""
  n = {"dynamic_update_slice": 2}.get(ctx.primitive.name, len(xs))
  return iv.join_all(xs[:n]) or ctx.top()


@RANGE_RULES.register(lax.iota_p)
def _iota(ctx, *, dimension, shape, **params):
  n = int(shape[dimension])
  return fit(Interval(0, max(n - 1, 0)), ctx.dtype())


@RANGE_RULES.register(lax.argmax_p, lax.argmin_p)
def _arg_reduce(ctx, x, *, axes, **params):
  n = int(ctx.eqn.invars[0].aval.shape[axes[0]])
  return fit(Interval(0, max(n - 1, 0)), ctx.dtype())


@RANGE_RULES.register(lax.reduce_sum_p, lax.cumsum_p)
def _sums(ctx, x, *, axes=None, axis=None, **params):
  shape = ctx.eqn.invars[0].aval.shape
  count = (math.prod(shape[a] for a in axes) if axes is not None
           else int(shape[axis]))
  if x is None:
    return ctx.top()
  terms = Interval(min(x.lo, 0), max(x.hi, 0)) if axis is not None else x
  return fit(Interval(count * terms.lo, count * terms.hi)
             if count else Interval(0, 0), ctx.dtype())


@RANGE_RULES.register(lax.optimization_barrier_p)
def _barrier(ctx, *xs, **params):
  return list(xs)


# ------------------------------------------------- calls jnp spells as jit

@functools.lru_cache(maxsize=64)
def _jnp_body(name: str, avals: tuple) -> str | None:
  """The text of the jaxpr that `jnp.<name>` traces to on `avals`."""
  fn = {"floor_divide": jnp.floor_divide, "remainder": jnp.remainder}[name]
  try:
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type)
            for a in avals]
    outer = jax.make_jaxpr(fn)(*args).jaxpr
  except Exception:  # noqa: BLE001 - avals jnp does not take: no match
    return None
  if len(outer.eqns) != 1 or "jaxpr" not in outer.eqns[0].params:
    return None
  return str(outer.eqns[0].params["jaxpr"])


_JNP_CALLS = {"floor_divide": iv.floor_div, "remainder": iv.py_mod}


def _jnp_call(ctx, args, params):
  """The interval of `jnp.floor_divide` / `jnp.remainder` (which jnp
  stages as a call of that name), when the call's body is exactly what jnp
  traces to: then Python's semantics hold, and the result is exact where
  the select in the body would lose the operands' correlation."""
  name = params.get("name")
  if (name not in _JNP_CALLS or len(args) != 2 or None in args
      or ctx.primitive is not pjit.jit_p):
    return None
  avals = tuple(v.aval for v in ctx.eqn.invars)
  if not all(iv.is_integer(a.dtype) for a in avals):
    return None
  if str(params["jaxpr"]) != _jnp_body(name, avals):
    return None
  out = _JNP_CALLS[name](*args)
  return None if out is None else [fit(out, ctx.dtype())]


@RANGE_RULES.register(*CALL_PRIMITIVES)
def _call(ctx, *args, **params):
  known = _jnp_call(ctx, args, params)
  if known is not None:
    return known
  body = call_body(params, args)
  if body is None:
    return top_rule(ctx, *args)
  return ctx.walk(*body)


# ------------------------------------------------------------ control flow

@RANGE_RULES.register(lax.cond_p)
def _cond(ctx, index, *ops, branches, **params):
  n = len(branches)
  lo, hi = (0, n - 1) if index is None else (
      min(max(index.lo, 0), n - 1), min(max(index.hi, 0), n - 1))
  for branch in branches:
    ctx.bind(branch.jaxpr.invars, ctx.eqn.invars[1:])
  outs = [ctx.walk_closed(branches[k], ops) for k in range(lo, hi + 1)]
  return [join(vals) for vals in zip(*outs)]


def join(values):
  """The join of the analysis values of one variable (intervals; None is
  unknown and absorbs)."""
  values = list(values)
  if not all(isinstance(v, Interval) for v in values):
    return None
  return iv.join_all(values)


def _producer(jaxpr: core.Jaxpr, var):
  for eqn in jaxpr.eqns:
    if var in eqn.outvars:
      return eqn
  return None


def _literal_int(atom) -> int | None:
  if isinstance(atom, core.Literal) and np.ndim(atom.val) == 0 and \
      iv.is_integer(np.asarray(atom.val).dtype):
    return int(atom.val)
  return None


def counter_step(body: core.Jaxpr, invar, outvar) -> int | None:
  """c if the loop body computes `outvar = invar + c` (c a literal)."""
  eqn = _producer(body, outvar) if isinstance(outvar, core.Var) else None
  if eqn is None or eqn.primitive not in (lax.add_p, lax.sub_p):
    return None
  a, b = eqn.invars
  if a is invar and _literal_int(b) is not None:
    c = _literal_int(b)
    return c if eqn.primitive is lax.add_p else -c
  if b is invar and eqn.primitive is lax.add_p:
    return _literal_int(a)
  return None


def _fixpoint(step, init: list, pinned: dict, rounds: int = 6) -> list:
  """Carry values that contain every iteration's, from `init`: carries in
  `pinned` keep their given value; the others are joined with what `step`
  makes of them until nothing grows, and widened to unknown (None, which
  `step` reads as the dtype's range) when they keep growing."""
  cur = [pinned.get(k, v) for k, v in enumerate(init)]
  widened: set = set()
  for n in range(rounds + len(init) + 1):
    outs = step(cur)
    new = [pinned[k] if k in pinned else
           None if k in widened else join([c, o])
           for k, (c, o) in enumerate(zip(cur, outs))]
    if new == cur:
      return cur
    if n >= rounds:
      widened |= {k for k, (c, o) in enumerate(zip(cur, new)) if c != o}
      new = [None if k in widened else v for k, v in enumerate(new)]
    cur = new
  # Unreachable (each widening round widens one more carry), and sound.
  return [pinned.get(k) for k in range(len(init))]


def _trip(init: Interval | None, step: int, trips: int, dtype):
  """The counter's values over `trips` iterations (None if it may wrap)."""
  if init is None or trips <= 0:
    return None
  span = Interval.hull([0, step * (trips - 1)])
  out = fit(init + span, dtype)
  return out if out != iv.dtype_range(dtype) else None


@RANGE_RULES.register(lax.scan_p)
def _scan(ctx, *args, jaxpr, length, **params):
  n_consts, n_carry, n_xs, n_ys = scan_layout(params)
  consts = list(args[:n_consts])
  init = list(args[n_consts:n_consts + n_carry])
  xs = [join([x]) for x in args[n_consts + n_carry:]]   # elements of xs
  length = int(length)
  if length == 0:
    return init + [ctx.top(n_carry + k) for k in range(n_ys)]
  body = jaxpr.jaxpr
  pinned, ends = {}, {}
  for k in range(n_carry):
    c = counter_step(body, body.invars[n_consts + k], body.outvars[k])
    dtype = body.invars[n_consts + k].aval.dtype
    trip = _trip(init[k], c, length, dtype) if c is not None else None
    if trip is not None:
      pinned[k] = trip
      ends[k] = fit(init[k] + Interval.const(c * length), dtype)
  run = lambda carry: ctx.walk_closed(jaxpr, consts + carry + xs)
  carry = _fixpoint(lambda c: run(c)[:n_carry], init, pinned)
  outs = run(carry)
  final = [ends[k] if k in pinned else join([init[k], outs[k]])
           for k in range(n_carry)]
  return final + outs[n_carry:]


def _bound_of(cond: core.Jaxpr, body: core.Jaxpr, k: int, cconsts, bconsts,
              carries) -> tuple[Interval, int] | None:
  """(B, inclusive) when the while loop's condition is `carry_k < B`
  (`carry_k <= B` with inclusive=1) for a B that stays fixed: a literal, a
  constant of the condition, or a carry the body passes through."""
  (out,) = cond.outvars
  eqn = _producer(cond, out) if isinstance(out, core.Var) else None
  if eqn is None or eqn.primitive not in (lax.lt_p, lax.le_p, lax.gt_p,
                                          lax.ge_p):
    return None
  a, b = eqn.invars
  if eqn.primitive in (lax.gt_p, lax.ge_p):
    a, b = b, a
  inclusive = int(eqn.primitive in (lax.le_p, lax.ge_p))
  n_cc = len(cconsts)
  if a is not cond.invars[n_cc + k]:
    return None
  if _literal_int(b) is not None:
    return Interval.const(_literal_int(b)), inclusive
  if b in cond.invars[:n_cc]:
    bound = cconsts[cond.invars.index(b)]
  elif b in cond.invars[n_cc:]:
    j = cond.invars.index(b) - n_cc
    if body.outvars[j] is not body.invars[len(bconsts) + j]:
      return None
    bound = carries[j]
  else:
    return None
  return (bound, inclusive) if isinstance(bound, Interval) else None


@RANGE_RULES.register(lax.while_p)
def _while(ctx, *args, cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts,
           **params):
  cconsts = list(args[:cond_nconsts])
  bconsts = list(args[cond_nconsts:cond_nconsts + body_nconsts])
  init = list(args[cond_nconsts + body_nconsts:])
  body, cond = body_jaxpr.jaxpr, cond_jaxpr.jaxpr
  in_body, at_cond = {}, {}
  for k in range(len(init)):
    c = counter_step(body, body.invars[body_nconsts + k], body.outvars[k])
    found = _bound_of(cond, body, k, cconsts, bconsts, init)
    if not c or c < 0 or found is None or not isinstance(init[k], Interval):
      continue
    (bound, inclusive), dtype = found, body.invars[body_nconsts + k].aval.dtype
    last = bound.hi - 1 + inclusive          # the largest value in the body
    after = fit(Interval.hull([init[k].hi, last + c]), dtype)
    if after == iv.dtype_range(dtype):
      continue                                # may wrap: not a counter
    at_cond[k] = Interval(init[k].lo, after.hi)
    if init[k].lo <= last:
      in_body[k] = Interval(init[k].lo, last)
  if any(k in at_cond and k not in in_body for k in range(len(init))):
    ctx.walk_closed(cond_jaxpr, cconsts + init)
    return init                               # the body never runs
  body_run = lambda carry: ctx.walk_closed(body_jaxpr, bconsts + carry)
  carry = _fixpoint(lambda c: body_run(c), init, in_body)
  body_run(carry)                             # records the body's accesses
  exits = [at_cond.get(k, v) for k, v in enumerate(carry)]
  ctx.walk_closed(cond_jaxpr, cconsts + exits)
  return [at_cond[k] if k in at_cond else join([init[k], v])
          for k, v in enumerate(carry)]


# ------------------------------------------------------------------ refs

@RANGE_RULES.register(state_primitives.get_p)
def _get(ctx, *args, **params):
  ops = ref_operands(ctx.primitive, args, params)
  ctx.access(ops.ref, ops.transforms)
  return ctx.top()


@RANGE_RULES.register(state_primitives.swap_p, state_primitives.addupdate_p)
def _swap(ctx, *args, **params):
  ops = ref_operands(ctx.primitive, args, params)
  reads = (ctx.primitive is state_primitives.addupdate_p
           or any(v in ctx.used for v in ctx.eqn.outvars))
  ctx.access(ops.ref, ops.transforms, reads)
  return [ctx.top(k) for k in range(len(ctx.eqn.outvars))]


@RANGE_RULES.register(ref_ops.masked_load_p, ref_ops.masked_store_p,
                      ref_ops.atomic_rmw_p, ref_ops.atomic_cas_p)
def _ref_op(ctx, *args, **params):
  ops = ref_operands(ctx.primitive, args, params)
  leaves = list(ops.leaves)
  if ops.mask is not None:
    leaves = _under_mask(ctx, ops, leaves)
  ctx.access(ops.ref, ops.transforms_of(leaves),
             reads=ctx.primitive is not ref_ops.masked_store_p)
  return [ctx.top(k) for k in range(len(ctx.eqn.outvars))]


def _under_mask(ctx, ops, leaves: list) -> list:
  """The indexer `leaves` with each array of indices of the mask's shape
  narrowed to what the mask lets through (dsl.core.mask_bounds): lanes
  the mask drops touch no memory. Only for a single indexer, whose lanes
  are the access's."""
  if len(ops.transforms) != 1:
    return leaves
  eqn_ops = eqn_ref_operands(ctx.eqn)
  lanes_of = (ctx.eqn.outvars[0] if ctx.primitive is ref_ops.masked_load_p
              else eqn_ops.value)
  mask = eqn_ops.mask
  out = list(leaves)
  for k, var in enumerate(eqn_ops.leaves):
    shape = getattr(getattr(var, "aval", None), "shape", ())
    if not shape or tuple(shape) != tuple(lanes_of.aval.shape):
      continue
    bound = mask_bounds.bounds_under_mask(var, mask, ctx.producers)
    if bound is not None and out[k] is not None:
      lo = max(out[k].lo, bound.lo)
      bound = Interval(lo, max(lo, min(out[k].hi, bound.hi)))
    out[k] = bound if bound is not None else out[k]
  return out


@RANGE_RULES.register(dsl_primitives.run_scoped_p)
def _run_scoped(ctx, *consts, jaxpr, num_consts, **params):
  refs = [ctx.new_buffer(v.aval, "run_scoped")
          for v in jaxpr.invars[num_consts:]]
  return ctx.walk_closed(jaxpr, list(consts) + refs)
