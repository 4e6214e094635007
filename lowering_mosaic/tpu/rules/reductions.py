"""Reductions -> `vector.multi_reduction`; argmax/argmin as max + index min.

Float max/min reductions propagate NaN (`maximumf`/`minimumf`), and
argmax/argmin return the first NaN's index in a row that holds one, as
jax.numpy does.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from dsl.core.jax_internals import arith, ir, tpu, vector

from lowering_mosaic.tpu import emit
from lowering_mosaic.tpu.host import constant
from lowering_mosaic.tpu.rules import register


def _kind(op: str, dtype) -> str:
  if op in ("add", "mul", "and", "or"):
    return op
  if emit.is_float(dtype):
    return {"max": "maximumf", "min": "minimumf"}[op]
  if emit.is_unsigned(dtype) or emit.is_bool(dtype):
    return {"max": "maxui", "min": "minui"}[op]
  return {"max": "maxsi", "min": "minsi"}[op]


def _identity(op: str, dtype):
  dtype = jnp.dtype(dtype)
  if op == "add":
    return 0
  if op == "mul":
    return 1
  if op == "and":
    return True if dtype == jnp.bool_ else -1
  if op == "or":
    return False if dtype == jnp.bool_ else 0
  if emit.is_float(dtype):
    return -np.inf if op == "max" else np.inf
  if dtype == jnp.bool_:
    return op == "min"
  info = jnp.iinfo(dtype)
  return int(info.min) if op == "max" else int(info.max)


def multi_reduction(x, in_shape, axes, op, dtype) -> ir.Value:
  """`vector.multi_reduction` over `axes`. Mosaic does not reduce to a
  scalar: a full reduction reduces a leading 1 dim's vector<1> and extracts
  (the form Pallas emits)."""
  axes = sorted(int(a) for a in axes)
  if not axes:
    return x
  if len(axes) == len(in_shape):
    lead = (1,) + tuple(in_shape)
    x = emit.reshape(x, in_shape, lead, dtype)
    r = multi_reduction(x, lead, [a + 1 for a in axes], op, dtype)
    return emit.reshape(r, (1,), (), dtype)
  out_shape = tuple(d for i, d in enumerate(in_shape) if i not in axes)
  acc = constant(_identity(op, dtype), out_shape, dtype)
  return vector.MultiDimReductionOp(
      ir.Attribute.parse(f"#vector.kind<{_kind(op, dtype)}>"), x, acc,
      axes).result


def _reduce(op):
  def rule(ctx, x, *, axes, out_sharding=None, **params):
    aval = ctx.avals_in[0]
    return multi_reduction(x, aval.shape, axes, op, aval.dtype)
  return rule


register(lax.reduce_sum_p)(_reduce("add"))
register(lax.reduce_prod_p)(_reduce("mul"))
register(lax.reduce_max_p)(_reduce("max"))
register(lax.reduce_min_p)(_reduce("min"))
register(lax.reduce_and_p)(_reduce("and"))
register(lax.reduce_or_p)(_reduce("or"))


def _arg_reduce(op):
  def rule(ctx, x, *, axes, index_dtype):
    aval = ctx.avals_in[0]
    (axis,) = axes
    shape = tuple(aval.shape)
    best = multi_reduction(x, shape, [axis], op, aval.dtype)
    kept = tuple(1 if i == axis else d for i, d in enumerate(shape))
    red_shape = tuple(d for i, d in enumerate(shape) if i != axis)
    best = emit.reshape(best, red_shape, kept, aval.dtype)
    best = vector.BroadcastOp(emit.vtype(shape, aval.dtype), best).result
    if emit.is_float(aval.dtype):
      # `best` is NaN when the row holds one (maximumf/minimumf propagate
      # it); NaN equals nothing, so NaN lanes are hits of their own and the
      # first NaN wins, as in jax.numpy. A row without NaN has no such lane.
      hit = arith.OrIOp(
          arith.CmpFOp(arith.CmpFPredicate.OEQ, x, best).result,
          arith.CmpFOp(arith.CmpFPredicate.UNO, x, x).result).result
    else:
      hit = arith.CmpIOp(arith.CmpIPredicate.eq, x, best).result
    iota = tpu.IotaOp(emit.vtype(shape, jnp.int32), [axis]).result
    big = constant(shape[axis], shape, jnp.int32)
    cand = emit.select(hit, iota, big)
    idx = multi_reduction(cand, shape, [axis], "min", jnp.int32)
    return emit.convert(idx, red_shape, jnp.int32, index_dtype)
  return rule


register(lax.argmax_p)(_arg_reduce("max"))
register(lax.argmin_p)(_arg_reduce("min"))
