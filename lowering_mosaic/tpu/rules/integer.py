"""Integer division, remainder and shifts, defined where `arith` is not.

`arith` leaves `divsi`/`remsi`/`divui`/`remui` by zero and `INT_MIN / -1`
undefined, and shifts by a negative amount or by the bit width or more
poison; a TPU gives whatever its instructions give. The module spells out
jax.numpy's answers on the CPU instead, so the interpreter, a TPU and the
other backends agree:

  lax.div(x, 0) = -1 (all bits set)      lax.rem(x, 0) = x
  lax.div(INT_MIN, -1) = INT_MIN         lax.rem(INT_MIN, -1) = 0
  x << s, logical x >> s = 0             arithmetic x >> s = the sign in
  for s < 0 or s >= width                every bit, for s < 0 or s >= width

(jnp's `//` and `%` are built from lax.div and lax.rem and follow.) A
divisor that is a constant other than 0 (and -1 for signed types), or a
shift by a constant in range, gets the plain operation.
"""
from __future__ import annotations

from jax import lax
from dsl.core.jax_internals import arith, ir

from lowering_mosaic.tpu import emit
from lowering_mosaic.tpu.host import constant
from lowering_mosaic.tpu.rules import register


def static_int(v: ir.Value) -> int | None:
  """The (signless) value of an integer constant or splat, else None."""
  owner = getattr(v, "owner", None)
  if getattr(owner, "name", None) != "arith.constant":
    return None
  attr = owner.attributes["value"]
  if isinstance(attr, ir.DenseElementsAttr):
    attr = ir.DenseElementsAttr(attr)
    if not attr.is_splat:
      return None
    attr = attr.get_splat_value()
  try:
    return ir.IntegerAttr(attr).value
  except (ValueError, TypeError):
    return None


def _eq(x, value, shape, dtype):
  return arith.CmpIOp(arith.CmpIPredicate.eq, x,
                      constant(value, shape, dtype)).result


def _int_operands(ctx, x, y):
  out = ctx.out_aval
  dtype = ctx.avals_in[0].dtype
  return (emit.broadcast_to(x, out.shape, dtype),
          emit.broadcast_to(y, out.shape, dtype), out.shape, dtype)


def _guarded_divisor(y, shape, dtype, signed: bool):
  """(divisor with 0 and, for signed types, -1 replaced by 1, y == 0,
  y == -1 or None)."""
  zero = _eq(y, 0, shape, dtype)
  minus_one = _eq(y, -1, shape, dtype) if signed else None
  bad = zero if minus_one is None else arith.OrIOp(zero, minus_one).result
  return emit.select(bad, constant(1, shape, dtype), y), zero, minus_one


@register(lax.div_p)
def _div(ctx, x, y, **_):
  x, y, shape, dtype = _int_operands(ctx, x, y)
  if emit.is_float(dtype):
    return arith.DivFOp(x, y).result
  signed = not emit.is_unsigned(dtype)
  op = arith.DivSIOp if signed else arith.DivUIOp
  c = static_int(y)
  if c is not None and c != 0 and not (signed and c == -1):
    return op(x, y).result
  safe, zero, minus_one = _guarded_divisor(y, shape, dtype, signed)
  q = op(x, safe).result
  if minus_one is not None:    # x / -1 = -x, wrapping (INT_MIN stays)
    q = emit.select(minus_one, arith.SubIOp(emit.zeros(shape, dtype),
                                            x).result, q)
  return emit.select(zero, constant(-1, shape, dtype), q)


@register(lax.rem_p)
def _rem(ctx, x, y, **_):
  x, y, shape, dtype = _int_operands(ctx, x, y)
  if emit.is_float(dtype):
    return arith.RemFOp(x, y).result
  signed = not emit.is_unsigned(dtype)
  op = arith.RemSIOp if signed else arith.RemUIOp
  c = static_int(y)
  if c is not None and c != 0 and not (signed and c == -1):
    return op(x, y).result
  safe, zero, _ = _guarded_divisor(y, shape, dtype, signed)
  return emit.select(zero, x, op(x, safe).result)   # x % -1 = x % 1 = 0


def _shift(op, arithmetic: bool):
  def rule(ctx, x, y, **_):
    x, y, shape, dtype = _int_operands(ctx, x, y)
    width = emit.bits(dtype)
    c = static_int(y)
    if c is not None and 0 <= c % (1 << width) < width:
      return op(x, y).result
    # unsigned compare: negative amounts are out of range too
    in_range = arith.CmpIOp(arith.CmpIPredicate.ult, y,
                            constant(width, shape, dtype)).result
    if arithmetic:   # shifting by width - 1 fills every bit with the sign
      return op(x, emit.select(in_range, y, constant(width - 1, shape,
                                                     dtype))).result
    zero = emit.zeros(shape, dtype)
    return emit.select(in_range, op(x, emit.select(in_range, y, zero)).result,
                       zero)
  return rule


register(lax.shift_left_p)(_shift(arith.ShLIOp, False))
register(lax.shift_right_logical_p)(_shift(arith.ShRUIOp, False))
register(lax.shift_right_arithmetic_p)(_shift(arith.ShRSIOp, True))
