"""Elementwise primitives: arithmetic, math functions, comparisons, bitwise
operations, `select_n` and `clamp` (casts: integer.py).

Float16/bfloat16/fp8 operands are computed in float32 and rounded back to
their dtype after each operation (as XLA does on CPU, and as Triton's math
functions require). Functions Triton lacks (tanh, log1p, expm1, pow, ...) are
written out from the ones it has.
"""
from __future__ import annotations

import numpy as np
from jax import lax
from dsl.core.jax_internals import ad_util, custom_derivatives, lax_special

from dsl.core.rule_helpers import power_by_squaring
from lowering_triton import triton_dtypes as dtypes
from lowering_triton.codegen import paren
from lowering_triton.rules import register
from lowering_triton.values import TVal, full_expr, literal_value


def result(ctx, expr: str, computed_in, hint: str):
  aval = ctx.out_aval
  return ctx.finish(expr, aval.shape, aval.dtype, computed_in,
                    hint=ctx.hint(hint))


# ------------------------------------------------------------- unary

def _unary(prim, template: str, hint: str, *, floats_only=False):
  @register(prim, fold=True)
  def rule(ctx, x, **params):
    if floats_only and not dtypes.is_float(x.dtype):
      raise ctx.error(f"'{ctx.primitive}' of {x.dtype} is not supported by the "
                      "Triton backend")
    cd = dtypes.compute_dtype(x.dtype)
    return result(ctx, template.format(x=ctx.compute(x)), cd, hint)
  return rule


_unary(lax.exp_p, "tl.exp({x})", "exp", floats_only=True)
_unary(lax.exp2_p, "tl.exp2({x})", "exp2", floats_only=True)
_unary(lax.log_p, "tl.log({x})", "log", floats_only=True)
_unary(getattr(lax, "log2_p", None), "tl.log2({x})", "log2", floats_only=True)
_unary(lax.sin_p, "tl.sin({x})", "sin", floats_only=True)
_unary(lax.cos_p, "tl.cos({x})", "cos", floats_only=True)
_unary(lax.tan_p, "tl.sin({x}) / tl.cos({x})", "tan", floats_only=True)
_unary(lax.sqrt_p, "tl.sqrt_rn({x})", "sqrt", floats_only=True)
_unary(lax.rsqrt_p, "tl.rsqrt({x})", "rsqrt", floats_only=True)
_unary(lax.logistic_p, "tl.sigmoid({x})", "sigmoid", floats_only=True)
_unary(lax_special.erf_p, "tl.erf({x})", "erf", floats_only=True)
_unary(lax_special.erfc_p, "1.0 - tl.erf({x})", "erfc", floats_only=True)
_unary(lax.floor_p, "tl.floor({x})", "floor", floats_only=True)
_unary(lax.ceil_p, "tl.ceil({x})", "ceil", floats_only=True)
_unary(lax.abs_p, "tl.abs({x})", "abs")
_unary(lax.neg_p, "-{x}", "neg")
_unary(lax.square_p, "{x} * {x}", "square")
_unary(getattr(lax, "one_minus_square_p", None), "1.0 - {x} * {x}",
       "one_minus_square", floats_only=True)
_unary(lax.copy_p, "{x}", "copy")


def _named_input(ctx, x: TVal, hint="x"):
  """`x` in its compute dtype, bound to a name (for reuse in formulas)."""
  e = ctx.compute(x)
  if e.isidentifier():
    return e
  return ctx.bind_raw(e, hint)


@register(lax.tanh_p, fold=True)
def _tanh(ctx, x, **params):
  xf = _named_input(ctx, x)
  a = ctx.bind_raw(f"tl.abs({xf})", "tanh_abs")
  e = ctx.bind_raw(f"tl.exp(-2.0 * {a})", "tanh_exp")
  big = ctx.bind_raw(f"(1.0 - {e}) / (1.0 + {e})", "tanh_big")
  x2 = ctx.bind_raw(f"{xf} * {xf}", "tanh_sq")
  # Near 0 the exp form cancels; the odd Taylor series is exact there.
  small = (f"{xf} * (1.0 + {x2} * (-0.3333333333333333 + {x2} * "
           f"(0.13333333333333333 + {x2} * -0.05396825396825397)))")
  expr = (f"tl.where({a} < 0.125, {small}, tl.where({xf} < 0, -{big}, {big}))")
  return result(ctx, expr, np.float32, "tanh")


@register(lax.sign_p, fold=True)
def _sign(ctx, x, **params):
  xf = _named_input(ctx, x)
  cd = dtypes.compute_dtype(x.dtype)
  if dtypes.is_float(cd):
    expr = f"tl.where({xf} > 0, 1.0, tl.where({xf} < 0, -1.0, {xf}))"
  elif dtypes.is_unsigned(cd):
    one, zero = (literal_value(v, cd).expr for v in (1, 0))
    expr = f"tl.where({xf} > 0, {one}, {zero})"
  else:
    one, minus, zero = (literal_value(v, cd).expr for v in (1, -1, 0))
    expr = f"tl.where({xf} > 0, {one}, tl.where({xf} < 0, {minus}, {zero}))"
  return result(ctx, expr, cd, "sign")


@register(lax.round_p)
def _round(ctx, x, rounding_method=0, **params):
  xf = _named_input(ctx, x)
  if int(rounding_method) == 0:      # away from zero
    expr = f"tl.where({xf} >= 0, tl.floor({xf} + 0.5), tl.ceil({xf} - 0.5))"
  else:                               # to nearest even
    r = ctx.bind_raw(f"tl.floor({xf} + 0.5)", "round_up")
    expr = (f"tl.where(({r} - {xf} == 0.5) & ({r} - 2.0 * tl.floor({r} * 0.5)"
            f" != 0.0), {r} - 1.0, {r})")
  return result(ctx, expr, np.float32, "round")


@register(lax.is_finite_p)
def _is_finite(ctx, x, **params):
  return result(ctx, f"tl.abs({ctx.compute(x)}) < float('inf')", np.bool_,
                 "is_finite")


@register(lax.integer_pow_p, fold=True)
def _integer_pow(ctx, x, y, **params):
  cd = dtypes.compute_dtype(x.dtype)
  base = _named_input(ctx, x)
  n = abs(int(y))
  if n == 0:
    return result(ctx, full_expr(x.shape, 1, cd), cd, "pow")
  # Exponentiation by squaring, with named partial products.
  acc = power_by_squaring(
      base, n, lambda a, b: ctx.bind_raw(f"{a} * {b}", "pow_acc"),
      lambda b: ctx.bind_raw(f"{b} * {b}", "pow_sq"))
  expr = acc if y > 0 else f"1.0 / {paren(acc)}"
  return result(ctx, expr, cd, "pow")


@register(lax.pow_p, fold=True)
def _pow(ctx, x, y, **params):
  if not dtypes.is_float(x.dtype):
    raise ctx.error("'pow' of integers is not supported by the Triton backend;"
                    " use lax.integer_pow (x ** n with a Python int n)")
  xf = _named_input(ctx, x, "pow_x")
  yf = ctx.compute(y) if dtypes.is_float(y.dtype) else \
      f"{paren(y.expr)}.to(tl.float32)"
  if not yf.isidentifier() and y.literal is None:
    yf = ctx.bind_raw(yf, "pow_y")
  r = ctx.bind_raw(f"tl.exp2({yf} * tl.log2(tl.abs({xf})))", "pow_mag")
  y_int = ctx.bind_raw(f"tl.floor({yf}) == {yf}", "pow_y_int")
  y_odd = ctx.bind_raw(
      f"{y_int} & (tl.abs({yf} - 2.0 * tl.floor({yf} * 0.5)) == 1.0)",
      "pow_y_odd")
  expr = (f"tl.where({yf} == 0.0, 1.0, tl.where({xf} < 0, tl.where({y_int}, "
          f"tl.where({y_odd}, -{r}, {r}), float('nan')), {r}))")
  return result(ctx, expr, np.float32, "pow")


# ------------------------------------------------------------- binary

def identity(op: str, a: TVal, b: TVal):
  """Algebraic identities with a constant operand, on integers and bools:
  `x + 0`, `x * 1`, `x % 1`, `p & True`, `p != False`, ... Index maps and
  jnp's integer helpers produce many of them."""
  if a.shape != b.shape:
    return None
  if a.dtype == np.bool_:
    for x, c in ((a, b), (b, a)):
      if c.literal is None:
        continue
      if op in ("!=", "^", "|") and c.literal is False:
        return x
      if op in ("&", "==") and c.literal is True:
        return x
      if op == "&" and c.literal is False:
        return c
      if op == "|" and c.literal is True:
        return c
    return None
  if not dtypes.is_int(a.dtype):
    return None
  if op == "%" and b.literal in (1, -1):
    return literal_value(0, a.dtype)
  if op == "*" and (a.literal == 0 or b.literal == 0):
    return literal_value(0, a.dtype)
  if op in ("+", "-", "|", "^", "<<", ">>") and b.literal == 0:
    return a
  if op in ("+", "|", "^") and a.literal == 0:
    return b
  if op == "*" and b.literal == 1:
    return a
  if op == "*" and a.literal == 1:
    return b
  return None


def _binary(prim, op: str, hint: str, *, kind="any"):
  """`op` is a Python operator (`+`) or a function template (`{a}`, `{b}`)."""
  @register(prim, fold=True)
  def rule(ctx, a, b, **params):
    same = identity(op, a, b)
    if same is not None:
      return same
    cd = dtypes.compute_dtype(a.dtype)
    ae, be = ctx.compute(a), ctx.compute(b)
    if "{" in op:
      expr = op.format(a=ae, b=be)
    else:
      expr = f"{paren(ae)} {op} {paren(be)}"
    out_dtype = ctx.out_aval.dtype
    computed = np.bool_ if out_dtype == np.bool_ else cd
    return result(ctx, expr, computed, hint)
  return rule


_binary(lax.add_p, "+", "add")
_binary(lax.sub_p, "-", "sub")
_binary(lax.mul_p, "*", "mul")
_binary(lax.and_p, "&", "and_")
_binary(lax.or_p, "|", "or_")
_binary(lax.xor_p, "^", "xor")
_binary(lax.eq_p, "==", "eq")
_binary(lax.ne_p, "!=", "ne")
_binary(lax.lt_p, "<", "lt")
_binary(lax.le_p, "<=", "le")
_binary(lax.gt_p, ">", "gt")
_binary(lax.ge_p, ">=", "ge")


def _minmax(prim, fn: str, bool_op: str):
  @register(prim, fold=True)
  def rule(ctx, a, b, **params):
    cd = dtypes.compute_dtype(a.dtype)
    ae, be = ctx.compute(a), ctx.compute(b)
    if cd == np.bool_:
      expr = f"{paren(ae)} {bool_op} {paren(be)}"
    elif dtypes.is_float(cd):
      expr = f"tl.{fn}({ae}, {be}, propagate_nan=tl.PropagateNan.ALL)"
    else:
      expr = f"tl.{fn}({ae}, {be})"
    return result(ctx, expr, cd, fn)
  return rule


_minmax(lax.max_p, "maximum", "|")
_minmax(lax.min_p, "minimum", "&")


@register(lax.select_n_p)
def _select_n(ctx, pred, *cases, **params):
  if pred.literal is not None:
    k = int(pred.literal)
    return cases[min(max(k, 0), len(cases) - 1)]
  out = ctx.out_aval
  vals = [ctx.value(c) for c in cases]
  if len(cases) == 1:
    return cases[0]
  if pred.dtype == np.bool_:
    expr = f"tl.where({pred.expr}, {vals[1]}, {vals[0]})"
  else:
    expr = vals[-1]
    for k in range(len(cases) - 2, -1, -1):
      expr = f"tl.where({paren(pred.expr)} == {k}, {vals[k]}, {expr})"
  return ctx.bind(expr, out.shape, out.dtype, ctx.hint("select"))


@register(lax.clamp_p, fold=True)
def _clamp(ctx, lo, x, hi, **params):
  cd = dtypes.compute_dtype(x.dtype)
  nan = ", propagate_nan=tl.PropagateNan.ALL" if dtypes.is_float(cd) else ""
  expr = (f"tl.minimum(tl.maximum({ctx.compute(x)}, {ctx.compute(lo)}{nan}), "
          f"{ctx.compute(hi)}{nan})")
  return result(ctx, expr, cd, "clamp")


@register(lax.reduce_precision_p)
def _reduce_precision(ctx, x, exponent_bits, mantissa_bits, **params):
  # Rounding through the narrower float type that has these bits.
  target = {(8, 7): "bfloat16", (5, 10): "float16", (8, 23): "float32"}.get(
      (int(exponent_bits), int(mantissa_bits)))
  if target is None:
    raise ctx.error(f"reduce_precision to {exponent_bits} exponent and "
                    f"{mantissa_bits} mantissa bits is not supported")
  expr = (f"{paren(ctx.compute(x))}.to(tl.{target}).to("
          f"{dtypes.tl_type(dtypes.compute_dtype(x.dtype))})")
  return result(ctx, expr, dtypes.compute_dtype(x.dtype), "reduce_precision")


@register(lax.optimization_barrier_p)
def _optimization_barrier(ctx, *args, **params):
  return list(args)


@register(custom_derivatives.stop_gradient_p)
def _stop_gradient(ctx, x, **params):
  return x


@register(ad_util.add_jaxvals_p)
def _add_any(ctx, a, b, **params):
  """The sum of two cotangents (from JAX's transposition)."""
  cd = dtypes.compute_dtype(a.dtype)
  return result(ctx, f"{paren(ctx.compute(a))} + {paren(ctx.compute(b))}",
                 cd, "add")
