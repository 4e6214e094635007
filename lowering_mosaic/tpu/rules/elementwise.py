"""Elementwise lax primitives -> `arith` / `math` ops (scalars or vectors).

Integer division, remainder and shifts are in `integer.py`."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from dsl.core.jax_internals import (BITCAST_TO_SAME_TYPE_ELIDED, ad_util,
                                    arith, lax_internal, mlir_math as math,
                                    tpu)

from dsl.core.rule_helpers import power_by_squaring
from lowering_mosaic.tpu import emit
from lowering_mosaic.tpu.host import constant
from lowering_mosaic.tpu.rules import register


def _operands(ctx, args):
  """Operands broadcast to the output shape (jaxprs may mix in scalars)."""
  out = ctx.out_aval
  return [emit.broadcast_to(a, out.shape, av.dtype)
          for a, av in zip(args, ctx.avals_in)]


def _by_type(float_op, signed_op, unsigned_op=None, bool_op=None):
  """A rule choosing an arith op by the operands' element type."""
  def rule(ctx, *args, **params):
    dtype = ctx.avals_in[0].dtype
    ops = _operands(ctx, args)
    if emit.is_float(dtype):
      op = float_op
    elif emit.is_bool(dtype) and bool_op is not None:
      op = bool_op
    elif emit.is_unsigned(dtype) and unsigned_op is not None:
      op = unsigned_op
    else:
      op = signed_op
    if op is None:
      raise ctx.error(f"is not supported for {dtype}")
    return op(*ops).result
  return rule


register(lax.add_p, ad_util.add_jaxvals_p)(_by_type(arith.AddFOp, arith.AddIOp,
                                       bool_op=arith.OrIOp))
register(lax.sub_p)(_by_type(arith.SubFOp, arith.SubIOp))
register(lax.mul_p)(_by_type(arith.MulFOp, arith.MulIOp, bool_op=arith.AndIOp))
register(lax.max_p)(_by_type(arith.MaximumFOp, arith.MaxSIOp, arith.MaxUIOp,
                             bool_op=arith.OrIOp))
register(lax.min_p)(_by_type(arith.MinimumFOp, arith.MinSIOp, arith.MinUIOp,
                             bool_op=arith.AndIOp))
register(lax.and_p)(_by_type(None, arith.AndIOp))
register(lax.or_p)(_by_type(None, arith.OrIOp))
register(lax.xor_p)(_by_type(None, arith.XOrIOp))
register(lax.atan2_p)(_by_type(math.Atan2Op, None))
register(lax.pow_p)(_by_type(math.PowFOp, None))


@register(lax.neg_p)
def _neg(ctx, x, **_):
  dtype = ctx.avals_in[0].dtype
  if emit.is_float(dtype):
    return arith.NegFOp(x).result
  zero = emit.zeros(ctx.avals_in[0].shape, dtype)
  return arith.SubIOp(zero, x).result


@register(lax.not_p)
def _not(ctx, x, **_):
  aval = ctx.avals_in[0]
  ones = constant(True if emit.is_bool(aval.dtype) else -1, aval.shape,
                  aval.dtype)
  return arith.XOrIOp(x, ones).result


@register(lax.abs_p)
def _abs(ctx, x, **_):
  if emit.is_float(ctx.avals_in[0].dtype):
    return math.AbsFOp(x).result
  return math.AbsIOp(x).result


def _unary_float(op):
  def rule(ctx, x, **params):
    if not emit.is_float(ctx.avals_in[0].dtype):
      raise ctx.error(f"needs a float operand, got {ctx.avals_in[0].dtype}")
    return op(x).result
  return rule


for _p, _op in [(lax.exp_p, math.ExpOp), (lax.exp2_p, math.Exp2Op),
                (lax.log_p, math.LogOp), (lax.log1p_p, math.Log1pOp),
                (lax.expm1_p, math.ExpM1Op), (lax.sqrt_p, math.SqrtOp),
                (lax.rsqrt_p, math.RsqrtOp), (lax.cbrt_p, math.CbrtOp),
                (lax.tanh_p, math.TanhOp), (lax.sin_p, math.SinOp),
                (lax.cos_p, math.CosOp), (lax.tan_p, math.TanOp),
                (lax.erf_p, math.ErfOp), (lax.floor_p, math.FloorOp),
                (lax.ceil_p, math.CeilOp)]:
  register(_p)(_unary_float(_op))


@register(lax.round_p)
def _round(ctx, x, *, rounding_method, **_):
  if rounding_method == lax.RoundingMethod.TO_NEAREST_EVEN:
    return math.RoundEvenOp(x).result
  return math.RoundOp(x).result


@register(lax.is_finite_p)
def _is_finite(ctx, x, **_):
  return math.IsFiniteOp(x).result


@register(lax.logistic_p)
def _logistic(ctx, x, **_):
  """Mosaic's own op on vectors (Pallas emits it too); `tpu.logistic`
  takes vectors only, so a scalar is 1 / (1 + exp(-x)), the op's
  forward-compatible spelling (Pallas's scalar module does not verify)."""
  aval = ctx.avals_in[0]
  if aval.shape:
    return tpu.LogisticOp(x).result
  one = constant(1.0, (), aval.dtype)
  denom = arith.AddFOp(one, math.ExpOp(arith.NegFOp(x).result).result).result
  return arith.DivFOp(one, denom).result


@register(lax.sign_p)
def _sign(ctx, x, **_):
  """Pallas's form: integers `(x > 0) - (x < 0)` (unsigned `x != 0`);
  floats the bits of 1.0 with x's sign bit where |x| > 0, else x (keeps
  NaN and -0)."""
  aval = ctx.avals_in[0]
  shape, dtype = aval.shape, aval.dtype
  zero = emit.zeros(shape, dtype)
  if not emit.is_float(dtype):
    if jnp.issubdtype(dtype, jnp.unsignedinteger):
      ne = arith.CmpIOp(arith.CmpIPredicate.ne, x, zero).result
      return emit.convert(ne, shape, jnp.bool_, dtype)
    pos = emit.convert(arith.CmpIOp(arith.CmpIPredicate.sgt, x, zero).result,
                       shape, jnp.bool_, dtype)
    neg = emit.convert(arith.CmpIOp(arith.CmpIPredicate.slt, x, zero).result,
                       shape, jnp.bool_, dtype)
    return arith.SubIOp(pos, neg).result
  bits = {2: (jnp.uint16, 0x8000, 0x3C00 if dtype == jnp.float16 else 0x3F80),
          4: (jnp.uint32, 0x80000000, 0x3F800000)}[jnp.dtype(dtype).itemsize]
  utype, sign_mask, one_bits = bits
  ix = _bitcast(x, shape, utype)
  sign_bit = arith.AndIOp(ix, constant(sign_mask, shape, utype)).result
  val = _bitcast(arith.OrIOp(constant(one_bits, shape, utype),
                             sign_bit).result, shape, dtype)
  nonzero = arith.CmpFOp(arith.CmpFPredicate.OGT, math.AbsFOp(x).result,
                         zero).result
  return emit.select(nonzero, val, x)


@register(lax.square_p)
def _square(ctx, x, **_):
  if emit.is_float(ctx.avals_in[0].dtype):
    return arith.MulFOp(x, x).result
  return arith.MulIOp(x, x).result


@register(lax.integer_pow_p)
def _integer_pow(ctx, x, *, y, **_):
  aval = ctx.avals_in[0]
  mul = arith.MulFOp if emit.is_float(aval.dtype) else arith.MulIOp
  if y == 0:
    return constant(1, aval.shape, aval.dtype)
  acc = power_by_squaring(x, abs(y), lambda a, b: mul(a, b).result)
  if y < 0:
    if not emit.is_float(aval.dtype):
      raise ctx.error("negative integer powers need a float operand")
    acc = arith.DivFOp(constant(1.0, aval.shape, aval.dtype), acc).result
  return acc


@register(lax.clamp_p)
def _clamp(ctx, lo, x, hi, **_):
  aval = ctx.out_aval
  lo = emit.broadcast_to(lo, aval.shape, aval.dtype)
  hi = emit.broadcast_to(hi, aval.shape, aval.dtype)
  if emit.is_float(aval.dtype):
    return arith.MinimumFOp(arith.MaximumFOp(x, lo).result, hi).result
  return arith.MinSIOp(arith.MaxSIOp(x, lo).result, hi).result


_FLOAT_CMP = {"eq": arith.CmpFPredicate.OEQ, "ne": arith.CmpFPredicate.UNE,
              "lt": arith.CmpFPredicate.OLT, "le": arith.CmpFPredicate.OLE,
              "gt": arith.CmpFPredicate.OGT, "ge": arith.CmpFPredicate.OGE}
_SIGNED_CMP = {"eq": arith.CmpIPredicate.eq, "ne": arith.CmpIPredicate.ne,
               "lt": arith.CmpIPredicate.slt, "le": arith.CmpIPredicate.sle,
               "gt": arith.CmpIPredicate.sgt, "ge": arith.CmpIPredicate.sge}
_UNSIGNED_CMP = {"eq": arith.CmpIPredicate.eq, "ne": arith.CmpIPredicate.ne,
                 "lt": arith.CmpIPredicate.ult, "le": arith.CmpIPredicate.ule,
                 "gt": arith.CmpIPredicate.ugt, "ge": arith.CmpIPredicate.uge}


def _compare(kind):
  def rule(ctx, x, y, **_):
    dtype = ctx.avals_in[0].dtype
    shape = ctx.out_aval.shape
    x = emit.broadcast_to(x, shape, dtype)
    y = emit.broadcast_to(y, shape, dtype)
    if emit.is_float(dtype):
      return arith.CmpFOp(_FLOAT_CMP[kind], x, y).result
    table = (_UNSIGNED_CMP if emit.is_unsigned(dtype) or emit.is_bool(dtype)
             else _SIGNED_CMP)
    return arith.CmpIOp(table[kind], x, y).result
  return rule


for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
  register(getattr(lax, f"{_name}_p"))(_compare(_name))


@register(lax.select_n_p)
def _select_n(ctx, which, *cases, **_):
  out = ctx.out_aval
  cases = [emit.broadcast_to(c, out.shape, out.dtype) for c in cases]
  waval = ctx.avals_in[0]
  if len(cases) == 1:
    return cases[0]
  if len(cases) == 2:
    # a scalar selector stays a scalar `i1` (as Pallas): `arith.select`
    # picks between whole vectors
    shape = () if waval.shape == () else out.shape
    which = emit.broadcast_to(which, shape, waval.dtype)
    if emit.is_bool(waval.dtype):
      return emit.select(which, cases[1], cases[0])
    # `which != 0` (as Pallas; folds a bool's extui)
    ne = arith.CmpIOp(arith.CmpIPredicate.ne, which,
                      constant(0, shape, waval.dtype)).result
    return emit.select(ne, cases[1], cases[0])
  which = emit.broadcast_to(which, out.shape, waval.dtype)
  # integer selector: a chain of compares, last case by default
  result = cases[-1]
  for k in range(len(cases) - 2, -1, -1):
    is_k = arith.CmpIOp(arith.CmpIPredicate.eq, which,
                        constant(k, out.shape, waval.dtype)).result
    result = emit.select(is_k, cases[k], result)
  return result


@register(lax.convert_element_type_p)
def _convert(ctx, x, *, new_dtype, weak_type=False, sharding=None):
  aval = ctx.avals_in[0]
  return emit.convert(x, aval.shape, aval.dtype, new_dtype)


@register(lax.bitcast_convert_type_p)
def _bitcast_convert(ctx, x, *, new_dtype):
  aval, out = ctx.avals_in[0], ctx.out_aval
  if emit.bits(aval.dtype) != emit.bits(new_dtype):
    raise ctx.error("between types of different widths is not supported; "
                    "use dsl.tpu.bitcast")
  # uint32 <-> int32 is one MLIR type (signless): the installed Pallas
  # returns the value as it is or bitcasts it (BITCAST_TO_SAME_TYPE_ELIDED)
  if BITCAST_TO_SAME_TYPE_ELIDED and x.type == emit.vtype(out.shape,
                                                           new_dtype):
    return x
  return _bitcast(x, out.shape, new_dtype)


def _bitcast(x, shape, dtype):
  """Same-width bitcast: `tpu.bitcast` of vectors, `arith.bitcast` of
  scalars (as Pallas)."""
  if shape:
    return tpu.BitcastOp(emit.vtype(shape, dtype), x).result
  return arith.BitcastOp(emit.vtype(shape, dtype), x).result


@register(lax_internal.copy_p, lax_internal.optimization_barrier_p)
def _copy(ctx, *args, **params):
  return args[0] if not ctx.eqn.primitive.multiple_results else list(args)


@register(lax.reduce_precision_p)
def _reduce_precision(ctx, x, **params):
  return x
