"""Control flow: `cond` (and `pl.when`) as `if`/`elif`, `while` as a Triton
`while` on a loop-carried flag (or a `for` loop when it counts up to a fixed
bound: `fori_loop` with bounds known at run time), `scan` from `fori_loop`
as a `for` loop, and calls (`jit`, custom derivatives, remat) inlined.

Values that flow out of a branch or around a loop get a name that every
branch and iteration assigns, so Triton sees a well-typed `scf.if`/`scf.for`.
"""
from __future__ import annotations

import numpy as np
from jax import lax
from dsl.core.jax_internals import ad_checkpoint, ClosedJaxpr, core

from dsl.core.jaxpr_walk import CALL_PRIMITIVES, call_body
from lowering_triton.rules import register
from lowering_triton.values import TVal
from lowering_triton.values import literal_value
from lowering_triton.triton_dtypes import tl_type


def _typed(v) -> str:
  """Source of a value usable as a loop-carried/branch-yielded tensor."""
  if not isinstance(v, TVal):
    raise TypeError(f"cannot carry {type(v).__name__} through control flow")
  return v.expr


def _is_empty(closed) -> bool:
  j = closed.jaxpr if isinstance(closed, ClosedJaxpr) else closed
  return not j.eqns and not j.outvars


def _assign(ctx, targets: list[TVal], values: list) -> None:
  """`target_i = value_i` for all i, safe when values name other targets."""
  names = {t.expr for t in targets}
  staged = []
  for t, v in zip(targets, values):
    e = _typed(v)
    if e != t.expr and e in names:
      e = ctx.bind_raw(e, "prev")
    staged.append(e)
  for t, e in zip(targets, staged):
    if e != t.expr:
      ctx.emit(f"{t.expr} = {e}")


@register(lax.cond_p)
def _cond(ctx, index, *ops, branches, **params):
  if index.literal is not None:
    k = min(max(int(index.literal), 0), len(branches) - 1)
    return ctx.lower_closed(branches[k], list(ops))
  outs = [TVal(ctx.fresh(ctx.hint("cond_out") if len(ctx.avals_out) == 1
                         else "cond_out"), tuple(a.shape), np.dtype(a.dtype))
          for a in ctx.avals_out]
  n = len(branches)
  if n == 2:
    src = index.bool_source
    # JAX's order: branch 0 (a false predicate's) first, as `index == 0`
    arms = [(f"if {index.expr} == 0:", 0), ("else:", 1)]
    if not outs and _is_empty(branches[0]):
      pred = src.expr if src is not None else f"{index.expr} != 0"
      arms = [(f"if {pred}:", 1)]
    elif not outs and _is_empty(branches[1]):
      neg = f"{index.expr} == 0" if src is None else f"~{src.expr}" \
          if src.expr.isidentifier() else f"~({src.expr})"
      arms = [(f"if {neg}:", 0)]
  else:
    arms = [(f"if {index.expr} <= 0:", 0)]
    arms += [(f"elif {index.expr} == {k}:", k) for k in range(1, n - 1)]
    arms += [("else:", n - 1)]
  for header, k in arms:
    with ctx.buf.indent(header):
      ctx.host.reset_comments()
      results = ctx.lower_closed(branches[k], list(ops))
      for o, r in zip(outs, results):
        ctx.emit(f"{o.expr} = {_typed(r)}")
  ctx.host.reset_comments()
  return outs


def _counted(cond_jaxpr, body_jaxpr, cconsts, body_nconsts, init):
  """(k, bound) when the loop counts carry k up by one while `carry_k <
  bound` for an int32 bound that stays fixed (a literal, a condition
  constant, or a carry the body passes through): what `fori_loop` makes of
  bounds known only at run time. Else None."""
  cond, body = cond_jaxpr.jaxpr, body_jaxpr.jaxpr
  k = _counter_index(body, body_nconsts, len(init), init)
  if k is None or init[k].dtype != np.int32 or len(cond.eqns) != 1:
    return None
  (eqn,) = cond.eqns
  n_cc = len(cconsts)
  if (eqn.primitive is not lax.lt_p or list(eqn.outvars) != list(cond.outvars)
      or eqn.invars[0] is not cond.invars[n_cc + k]):
    return None
  b = eqn.invars[1]
  if isinstance(b, core.Literal):
    bound = literal_value(int(np.asarray(b.val)), np.int32)
  elif b in cond.invars[:n_cc]:
    bound = cconsts[cond.invars.index(b)]
  else:
    j = cond.invars.index(b) - n_cc if b in cond.invars[n_cc:] else None
    if j is None or body.outvars[j] is not body.invars[body_nconsts + j]:
      return None
    bound = init[j]
  if not isinstance(bound, TVal) or bound.shape or bound.dtype != np.int32:
    return None
  return k, bound


def _counted_for(ctx, k, bound, bconsts, body_jaxpr, init):
  """`for i in tl.range(start, bound)`: a loop Triton pipelines (it does not
  pipeline `while` loops)."""
  carries = []
  for n, v in enumerate(init):
    if n == k:
      carries.append(None)
      continue
    name = ctx.fresh("carry")
    ctx.emit(f"{name} = {_typed(v)}")
    carries.append(TVal(name, v.shape, v.dtype))
  iv = _loop_var_name(ctx, body_jaxpr.jaxpr)
  start = init[k]
  header = f"for {iv} in tl.range({start.expr}, {bound.expr}):"
  with ctx.buf.indent(header), ctx.host.in_loop():
    ctx.host.reset_comments()
    mark = ctx.host.writes_mark()
    loop_args = list(carries)
    loop_args[k] = TVal(iv, (), np.dtype(np.int32))
    new = ctx.lower_closed(body_jaxpr, bconsts + loop_args)
    _assign(ctx, [c for c in carries if c is not None],
            [v for n, v in enumerate(new) if n != k])
    ctx.host.end_of_loop_body(mark)
  ctx.host.reset_comments()
  carries[k] = ctx.bind(f"tl.maximum({start.expr}, {bound.expr})", (),
                        np.dtype(np.int32), "index_end")
  return carries


@register(lax.while_p)
def _while(ctx, *args, cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts,
           **params):
  cconsts = list(args[:cond_nconsts])
  bconsts = list(args[cond_nconsts:cond_nconsts + body_nconsts])
  init = args[cond_nconsts + body_nconsts:]
  counted = _counted(cond_jaxpr, body_jaxpr, cconsts, body_nconsts, init)
  if counted is not None:
    return _counted_for(ctx, *counted, bconsts, body_jaxpr, init)
  carries = []
  for v in init:
    name = ctx.fresh("carry")
    ctx.emit(f"{name} = {_typed(v)}")
    carries.append(TVal(name, v.shape, v.dtype))
  go = ctx.fresh("keep_going")
  (pred,) = ctx.lower_closed(cond_jaxpr, cconsts + carries)
  ctx.emit(f"{go} = {_typed(pred)}")
  with ctx.buf.indent(f"while {go}:"), ctx.host.in_loop():
    ctx.host.reset_comments()
    mark = ctx.host.writes_mark()
    new = ctx.lower_closed(body_jaxpr, bconsts + carries)
    _assign(ctx, carries, new)
    (pred,) = ctx.lower_closed(cond_jaxpr, cconsts + carries)
    ctx.emit(f"{go} = {_typed(pred)}")
    ctx.host.end_of_loop_body(mark)
  ctx.host.reset_comments()
  return carries


def _producer(jaxpr: core.Jaxpr, var):
  for eqn in jaxpr.eqns:
    if var in eqn.outvars:
      return eqn
  return None


def _counter_index(jaxpr: core.Jaxpr, n_consts: int, n_carry: int, init):
  """The carry that a fori_loop increments by one per step, if any."""
  for k in range(n_carry):
    inv = jaxpr.invars[n_consts + k]
    outv = jaxpr.outvars[k]
    if not isinstance(outv, core.Var):
      continue
    eqn = _producer(jaxpr, outv)
    if eqn is None or eqn.primitive is not lax.add_p:
      continue
    a, b = eqn.invars
    one = [x for x in (a, b) if isinstance(x, core.Literal)]
    if inv in (a, b) and one and np.asarray(one[0].val) == 1 and \
        isinstance(init[k], TVal) and init[k].shape == () and \
        np.issubdtype(init[k].dtype, np.integer):
      return k
  return None


def _loop_var_name(ctx, jaxpr) -> str:
  names = getattr(getattr(jaxpr, "debug_info", None), "arg_names", None) or ()
  for n in names:
    if n and n.isidentifier() and n not in ("carry", "_"):
      return ctx.fresh(n)
  return ctx.fresh("step")


@register(lax.scan_p)
def _scan(ctx, *args, jaxpr, length, reverse=False, unroll=1, **params):
  if "ft_in" in params:
    n_consts, n_carry, n_xs = (len(p) for p in params["ft_in"].unpack())
    n_ys = len(params["ft_out"].unpack()[1])
  else:
    n_consts, n_carry = params["num_consts"], params["num_carry"]
    n_xs = len(args) - n_consts - n_carry
    n_ys = len(jaxpr.out_avals) - n_carry
  if n_xs or n_ys:
    raise ctx.error("lax.scan over arrays (xs/ys) is not supported by the "
                    "Triton backend; use lax.fori_loop and index refs instead")
  consts = list(args[:n_consts])
  init = list(args[n_consts:n_consts + n_carry])
  body = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
  counter = _counter_index(body, n_consts, n_carry, init)
  carries = []
  for k, v in enumerate(init):
    if k == counter:
      carries.append(None)
      continue
    name = ctx.fresh("carry")
    ctx.emit(f"{name} = {_typed(v)}")
    carries.append(TVal(name, v.shape, v.dtype))
  iv = _loop_var_name(ctx, jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr)
                      else jaxpr)
  length = int(length)
  static = unroll is True or (not isinstance(unroll, bool) and
                              int(unroll) > 1 and int(unroll) >= length)
  rng = "tl.static_range" if static else "tl.range"
  header = f"for {iv} in {rng}(0, {length}):"
  with ctx.buf.indent(header), ctx.host.in_loop():
    ctx.host.reset_comments()
    loop_args = list(carries)
    if counter is not None:
      start = init[counter]
      if start.literal is not None and int(start.literal) == 0 and \
          start.dtype == np.int32:
        loop_args[counter] = TVal(iv, (), np.dtype(np.int32))
      else:
        expr = f"{start.expr} + {iv}"
        if start.dtype != np.int32:
          expr = f"{start.expr} + {iv}.to({_tl(start.dtype)})"
        loop_args[counter] = ctx.bind(expr, (), start.dtype, "index")
    mark = ctx.host.writes_mark()
    new = ctx.lower_closed(jaxpr, consts + loop_args)
    targets = [c for c in carries if c is not None]
    values = [v for k, v in enumerate(new[:n_carry]) if k != counter]
    _assign(ctx, targets, values)
    ctx.host.end_of_loop_body(mark)
  ctx.host.reset_comments()
  outs = list(carries)
  if counter is not None:
    start = init[counter]
    if start.literal is not None:
      outs[counter] = literal_value(int(start.literal) + length, start.dtype)
    else:
      outs[counter] = ctx.bind(f"{start.expr} + {length}", (), start.dtype,
                               "index_end")
  return outs


def _tl(dtype) -> str:
  return tl_type(dtype)


@register(*CALL_PRIMITIVES)
def _inline(ctx, *args, **params):
  body = call_body(params, args)
  if body is None:
    raise ctx.error(f"cannot inline '{ctx.primitive}': no jaxpr parameter")
  return ctx.host.lower_jaxpr(*body)


@register(ad_checkpoint.name_p)
def _name_identity(ctx, x, **params):
  return x
