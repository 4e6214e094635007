"""Integer operations whose result LLVM (and so the GPU) leaves undefined,
written out with jax.numpy's answers on the CPU (XLA's):

- `lax.div` by zero is -1 (all bits set; the maximum for unsigned types),
  `lax.rem` by zero is the dividend, `INT_MIN / -1` is INT_MIN and
  `INT_MIN % -1` is 0: the divisor is replaced by 1 where it is 0 (or -1)
  and the result picked with `tl.where`, so no lane divides by zero;
- shifts by a negative amount or by the width or more give 0 (left and
  logical right shifts) or the sign (arithmetic right shifts);
- float -> int casts saturate at the type's bounds and turn NaN into 0
  (every cast's rule is here: `convert_element_type`,
  `bitcast_convert_type`).

Operands that are constants in the valid range get the plain operator.
"""
from __future__ import annotations

import numpy as np
from jax import lax

from lowering_triton import triton_dtypes as dtypes
from lowering_triton.codegen import paren
from lowering_triton.rules import register
from lowering_triton.rules.elementwise import identity, result
from lowering_triton.values import TVal, literal_value


def _const(ctx, value, dtype) -> str:
  """A constant of exactly `dtype` (a Python literal for the default types)."""
  return ctx.compute(literal_value(value, dtype))


def _named(ctx, x: TVal, hint: str) -> str:
  """`x` in its compute dtype, bound to a name when it is an expression."""
  e = ctx.compute(x)
  if x.literal is not None or e.isidentifier():
    return e
  return ctx.bind_raw(e, hint)


def _signed(dtype) -> bool:
  return dtypes.is_int(dtype) and not dtypes.is_unsigned(dtype)


def _safe_literal_divisor(b: TVal) -> bool:
  return b.literal is not None and b.literal != 0 and not (
      _signed(b.dtype) and b.literal == -1)


def _safe_divisor(ctx, b: str, dtype) -> str:
  """`b` with 0 (and -1 for signed types) replaced by 1."""
  bad = f"({b} == 0) | ({b} == -1)" if _signed(dtype) else f"{b} == 0"
  return ctx.bind_raw(f"tl.where({bad}, {_const(ctx, 1, dtype)}, {b})",
                      "divisor")


@register(lax.div_p, fold=True)
def _div(ctx, a, b, **params):
  cd = dtypes.compute_dtype(a.dtype)
  if dtypes.is_float(cd):
    return result(ctx, f"{paren(ctx.compute(a))} / {paren(ctx.compute(b))}",
                  cd, "div")
  if b.literal == 1:
    return a
  # Triton's // on integers truncates, as lax.div does.
  if _safe_literal_divisor(b):
    return result(ctx, f"{paren(ctx.compute(a))} // {paren(ctx.compute(b))}",
                  cd, "div")
  ae, be = _named(ctx, a, "dividend"), _named(ctx, b, "divisor")
  quotient = f"{paren(ae)} // {_safe_divisor(ctx, be, cd)}"
  if _signed(cd):
    quotient = f"tl.where({be} == -1, -{paren(ae)}, {quotient})"
  all_ones = _const(ctx, -1 if _signed(cd) else np.iinfo(cd).max, cd)
  return result(ctx, f"tl.where({be} == 0, {all_ones}, {quotient})", cd, "div")


@register(lax.rem_p, fold=True)
def _rem(ctx, a, b, **params):
  same = identity("%", a, b)
  if same is not None:
    return same
  cd = dtypes.compute_dtype(a.dtype)
  if dtypes.is_float(cd) or _safe_literal_divisor(b):
    return result(ctx, f"{paren(ctx.compute(a))} % {paren(ctx.compute(b))}",
                  cd, "rem")
  ae, be = _named(ctx, a, "dividend"), _named(ctx, b, "divisor")
  expr = f"tl.where({be} == 0, {ae}, {paren(ae)} % {_safe_divisor(ctx, be, cd)})"
  return result(ctx, expr, cd, "rem")


# ------------------------------------------------------------- shifts

def _in_width(ctx, b: TVal, bits: int) -> str | None:
  """A condition true where the shift amount `b` is in [0, bits), or None
  when it is a constant in that range."""
  if b.literal is not None:
    return None if 0 <= b.literal < bits else "False"
  be = _named(ctx, b, "shift")
  if _signed(b.dtype):
    return f"({be} >= 0) & ({be} < {bits})"
  return f"{be} < {bits}"


def _bits(dtype) -> int:
  return np.dtype(dtype).itemsize * 8


def _as(expr: str, dtype) -> str:
  return f"{paren(expr)}.to({dtypes.tl_type(dtype)}, bitcast=True)"


@register(lax.shift_left_p, fold=True)
def _shift_left(ctx, a, b, **params):
  same = identity("<<", a, b)
  if same is not None:
    return same
  expr = f"{paren(ctx.compute(a))} << {paren(ctx.compute(b))}"
  ok = _in_width(ctx, b, _bits(a.dtype))
  if ok is not None:
    expr = f"tl.where({ok}, {expr}, {_const(ctx, 0, a.dtype)})"
  return result(ctx, expr, a.dtype, "shl")


@register(lax.shift_right_arithmetic_p, fold=True)
def _shift_right_arithmetic(ctx, a, b, **params):
  same = identity(">>", a, b)
  if same is not None:
    return same
  bits = _bits(a.dtype)
  signed = np.dtype(f"int{bits}")
  ae, be = ctx.compute(a), ctx.compute(b)
  if dtypes.is_unsigned(a.dtype):
    # An arithmetic shift copies the top bit: shift the signed bit pattern.
    ae, be = _as(a.expr, signed), _as(b.expr, signed)
  ok = _in_width(ctx, b, bits)
  if ok is not None:
    # By the width or more: the sign in every bit, as a shift by bits - 1.
    be = f"tl.where({ok}, {be}, {_const(ctx, bits - 1, signed)})"
  expr = f"{paren(ae)} >> {paren(be)}"
  if dtypes.is_unsigned(a.dtype):
    expr = _as(expr, a.dtype)
  return result(ctx, expr, a.dtype, "shr")


@register(lax.shift_right_logical_p, fold=True)
def _shift_right_logical(ctx, a, b, **params):
  same = identity(">>", a, b)
  if same is not None:
    return same
  bits = _bits(a.dtype)
  unsigned = np.dtype(f"uint{bits}")
  ae, be = ctx.compute(a), ctx.compute(b)
  if not dtypes.is_unsigned(a.dtype):
    ae, be = _as(a.expr, unsigned), _as(b.expr, unsigned)
  expr = f"{paren(ae)} >> {paren(be)}"
  ok = _in_width(ctx, b, bits)
  if ok is not None:
    expr = f"tl.where({ok}, {expr}, {_const(ctx, 0, unsigned)})"
  if not dtypes.is_unsigned(a.dtype):
    expr = _as(expr, a.dtype)
  return result(ctx, expr, a.dtype, "shr")


@register(lax.not_p, fold=True)
def _not(ctx, x, **params):
  if dtypes.is_unsigned(x.dtype):
    # x ^ all-ones (Triton's interpreter cannot build ~ of unsigned types).
    mask = _const(ctx, np.iinfo(x.dtype).max, x.dtype)
    return result(ctx, f"{paren(ctx.compute(x))} ^ {mask}", x.dtype, "not_")
  return result(ctx, f"~{paren(ctx.compute(x))}", x.dtype, "not_")


# ------------------------------------------------------------- casts

def float_to_int(ctx, x: TVal, dtype) -> str:
  """`x` (floating) converted to the integer type `dtype`: truncated toward
  zero, saturated at the type's bounds, NaN to 0."""
  info = np.iinfo(dtype)
  xf = _named(ctx, x, "x")
  lo, hi = float(info.min), float(info.max) + 1.0   # both exact in floats
  zero = "0.0"
  inside = ctx.bind_raw(
      f"tl.where(({xf} > {lo!r}) & ({xf} < {hi!r}), {xf}, {zero})"
      f".to({dtypes.tl_type(dtype)})", "truncated")
  return (f"tl.where({xf} >= {hi!r}, {_const(ctx, info.max, dtype)}, "
          f"tl.where({xf} <= {lo!r}, {_const(ctx, info.min, dtype)}, "
          f"{inside}))")


@register(lax.convert_element_type_p)
def _convert(ctx, x, new_dtype, **params):
  new_dtype = np.dtype(new_dtype)
  if x.literal is not None:
    return literal_value(x.literal, new_dtype)
  if x.dtype == new_dtype:
    return x
  if new_dtype == np.bool_:
    expr = f"{paren(ctx.compute(x))} != 0"
  elif dtypes.is_float(x.dtype) and dtypes.is_int(new_dtype):
    expr = float_to_int(ctx, x, new_dtype)
  else:
    expr = f"{paren(x.expr)}.to({dtypes.tl_type(new_dtype)})"
  if x.dtype == np.bool_:
    # Left unbound: `lax.cond` turns its bool into an int index this way,
    # and the `if` reads the bool itself.
    return TVal(paren(expr), x.shape, new_dtype, bool_source=x)
  return ctx.bind(expr, x.shape, new_dtype,
                  ctx.hint(f"{x.expr}_{new_dtype.name}" if x.expr.isidentifier()
                           else "cast"))


@register(lax.bitcast_convert_type_p)
def _bitcast(ctx, x, new_dtype, **params):
  new_dtype = np.dtype(new_dtype)
  if np.dtype(x.dtype).itemsize != new_dtype.itemsize:
    raise ctx.error(f"bitcast from {x.dtype} to {new_dtype} changes the width;"
                    " the Triton backend supports same-width bitcasts only")
  expr = f"{paren(x.expr)}.to({dtypes.tl_type(new_dtype)}, bitcast=True)"
  return ctx.bind(expr, x.shape, new_dtype, ctx.hint("bitcast"))
