"""Elementwise math, comparisons, casts and `where` on scalars and vectors.

Vectors are whole-warpgroup values: the library's layout inference gives
each op a register layout and lowers it to FragmentedArray math.
"""
from __future__ import annotations

import numpy as np
from jax import lax
from dsl.core.jax_internals import (ad_util, arith, custom_derivatives,
                                    mlir_math, mosaic_gpu_dialect as mgpu)

from dsl.core import dtypes, primitives
from dsl.core.rule_helpers import power_by_squaring
from lowering_mosaic.gpu.host import constant, shape_of, to_shape, typed
from lowering_mosaic.gpu.rules import TABLE


def _same_shape(ctx, args):
  shape = tuple(ctx.out_aval.shape)
  return [to_shape(a, aval.shape, shape, aval.dtype)
          for a, aval in zip(args, ctx.avals_in[-len(args):])]


def _kind(dtype) -> str:
  if dtypes.is_float(dtype):
    return "f"
  if dtypes.is_bool(dtype) or dtypes.is_unsigned(dtype):
    return "u"
  return "s"


# primitive -> {dtype kind: arith builder}
_BINARY = {
    lax.add_p: {"f": arith.addf, "s": arith.addi, "u": arith.addi},
    lax.sub_p: {"f": arith.subf, "s": arith.subi, "u": arith.subi},
    lax.mul_p: {"f": arith.mulf, "s": arith.muli, "u": arith.muli},
    lax.div_p: {"f": arith.divf, "s": arith.divsi, "u": arith.divui},
    lax.rem_p: {"f": arith.remf, "s": arith.remsi, "u": arith.remui},
    lax.max_p: {"f": arith.maximumf, "s": arith.maxsi, "u": arith.maxui},
    lax.min_p: {"f": arith.minimumf, "s": arith.minsi, "u": arith.minui},
    lax.and_p: {"s": arith.andi, "u": arith.andi},
    lax.or_p: {"s": arith.ori, "u": arith.ori},
    lax.xor_p: {"s": arith.xori, "u": arith.xori},
    lax.shift_left_p: {"s": arith.shli, "u": arith.shli},
    lax.shift_right_arithmetic_p: {"s": arith.shrsi, "u": arith.shrsi},
    lax.shift_right_logical_p: {"s": arith.shrui, "u": arith.shrui},
}


def _binary_rule(prim):
  table = _BINARY[prim]

  def rule(ctx, x, y, **_):
    build = table.get(_kind(ctx.avals_in[0].dtype))
    if build is None:
      raise ctx.error(f"'{prim.name}' is not defined on "
                      f"{ctx.avals_in[0].dtype}")
    x, y = _same_shape(ctx, (x, y))
    return build(x, y)
  return rule


for _p in _BINARY:
  TABLE.register(_p)(_binary_rule(_p))
# The sum of two cotangents, from JAX's transposition (derived kernels).
TABLE.register(ad_util.add_jaxvals_p)(_binary_rule(lax.add_p))

_UNARY_FLOAT = {
    lax.exp_p: mlir_math.exp, lax.exp2_p: mlir_math.exp2,
    lax.log_p: mlir_math.log, lax.tanh_p: mlir_math.tanh,
    lax.sqrt_p: mlir_math.sqrt, lax.rsqrt_p: mlir_math.rsqrt,
    lax.sin_p: mlir_math.sin, lax.cos_p: mlir_math.cos,
    lax.erf_p: mlir_math.erf, lax.abs_p: mlir_math.absf,
    lax.round_p: mlir_math.roundeven,
}

# What `approx_math` (plgpu.CompilerParams) computes approximately.
_APPROXIMABLE = (lax.exp_p, lax.exp2_p, lax.log_p, lax.tanh_p, lax.sqrt_p,
                 lax.rsqrt_p, lax.sin_p, lax.cos_p)


def _unary_rule(prim):
  build = _UNARY_FLOAT[prim]

  def rule(ctx, x, **params):
    if prim is lax.abs_p and not dtypes.is_float(ctx.avals_in[0].dtype):
      return mlir_math.absi(x)
    if not dtypes.is_float(ctx.avals_in[0].dtype):
      raise ctx.error(f"'{prim.name}' needs a floating-point operand")
    if prim is lax.round_p and int(params.get("rounding_method", 0)) == 0:
      return mlir_math.round(x)         # away from zero
    if ctx.host.approx_math and prim in _APPROXIMABLE:
      return build(x, fastmath=arith.FastMathFlags.afn)
    return build(x)
  return rule


for _p in _UNARY_FLOAT:
  TABLE.register(_p)(_unary_rule(_p))


@TABLE.register(lax.neg_p)
def _neg(ctx, x, **_):
  if dtypes.is_float(ctx.avals_in[0].dtype):
    return arith.negf(x)
  aval = ctx.avals_in[0]
  return arith.subi(constant(0, aval.shape, aval.dtype), x)


@TABLE.register(lax.not_p)
def _not(ctx, x, **_):
  aval = ctx.avals_in[0]
  ones = constant(1 if dtypes.is_bool(aval.dtype) else -1, aval.shape,
                  aval.dtype)
  return arith.xori(x, ones)


@TABLE.register(lax.sign_p)
def _sign(ctx, x, **_):
  aval = ctx.avals_in[0]
  shape, dtype = tuple(aval.shape), aval.dtype
  zero, one, minus = (constant(v, shape, dtype) for v in (0, 1, -1))
  if dtypes.is_float(dtype):
    pos = arith.cmpf(arith.CmpFPredicate.OGT, x, zero)
    neg = arith.cmpf(arith.CmpFPredicate.OLT, x, zero)
    # x itself where it is zero or NaN (sign(-0.) is -0., sign(nan) is nan)
    return arith.select(pos, one, arith.select(neg, minus, x))
  if _kind(dtype) == "u":
    return arith.select(arith.cmpi(arith.CmpIPredicate.ne, x, zero), one,
                        zero)
  pos = arith.cmpi(arith.CmpIPredicate.sgt, x, zero)
  neg = arith.cmpi(arith.CmpIPredicate.slt, x, zero)
  return arith.select(pos, one, arith.select(neg, minus, zero))


@TABLE.register(lax.logistic_p)
def _logistic(ctx, x, **_):
  aval = ctx.avals_in[0]
  one = constant(1.0, aval.shape, aval.dtype)
  return arith.divf(one, arith.addf(one, mlir_math.exp(arith.negf(x))))


@TABLE.register(lax.integer_pow_p)
def _integer_pow(ctx, x, *, y):
  aval = ctx.avals_in[0]
  mul = arith.mulf if dtypes.is_float(aval.dtype) else arith.muli
  if y == 0:
    return constant(1, aval.shape, aval.dtype)
  acc = power_by_squaring(x, abs(y), mul)
  if y < 0:
    acc = arith.divf(constant(1.0, aval.shape, aval.dtype), acc)
  return acc


_CMP_F = {lax.eq_p: arith.CmpFPredicate.OEQ, lax.ne_p: arith.CmpFPredicate.UNE,
          lax.lt_p: arith.CmpFPredicate.OLT, lax.le_p: arith.CmpFPredicate.OLE,
          lax.gt_p: arith.CmpFPredicate.OGT, lax.ge_p: arith.CmpFPredicate.OGE}
_CMP_I = {lax.eq_p: ("eq", "eq"), lax.ne_p: ("ne", "ne"),
          lax.lt_p: ("slt", "ult"), lax.le_p: ("sle", "ule"),
          lax.gt_p: ("sgt", "ugt"), lax.ge_p: ("sge", "uge")}


def _compare_rule(prim):
  def rule(ctx, x, y, **_):
    x, y = _same_shape(ctx, (x, y))
    dtype = ctx.avals_in[0].dtype
    if dtypes.is_float(dtype):
      return arith.cmpf(_CMP_F[prim], x, y)
    signed, unsigned = _CMP_I[prim]
    pred = unsigned if _kind(dtype) == "u" else signed
    return arith.cmpi(getattr(arith.CmpIPredicate, pred), x, y)
  return rule


for _p in _CMP_F:
  TABLE.register(_p)(_compare_rule(_p))


@TABLE.register(lax.clamp_p)
def _clamp(ctx, lo, x, hi, **_):
  kind = _kind(ctx.avals_in[1].dtype)
  mx, mn = _BINARY[lax.max_p][kind], _BINARY[lax.min_p][kind]
  lo, x, hi = _same_shape(ctx, (lo, x, hi))
  return mn(mx(x, lo), hi)


@TABLE.register(lax.select_n_p)
def _select_n(ctx, which, *cases, **_):
  if len(cases) != 2:
    raise ctx.error("select_n with more than two cases is not supported")
  shape = tuple(ctx.out_aval.shape)
  which = to_shape(which, ctx.avals_in[0].shape, shape, ctx.avals_in[0].dtype)
  if not dtypes.is_bool(ctx.avals_in[0].dtype):
    aval = ctx.avals_in[0]
    which = arith.cmpi(arith.CmpIPredicate.ne, which,
                       constant(0, shape, aval.dtype))
  false_case, true_case = (to_shape(c, aval.shape, shape, aval.dtype)
                           for c, aval in zip(cases, ctx.avals_in[1:]))
  return arith.select(which, true_case, false_case)


def convert(x, src, dst, shape):
  """`x` (dtype `src`) converted to `dst` with JAX's semantics."""
  src, dst = np.dtype(src), np.dtype(dst)
  out = typed(shape, dst)
  if src == dst:
    return x
  if dtypes.is_bool(dst):
    zero = constant(0, shape, src)
    if dtypes.is_float(src):
      return arith.cmpf(arith.CmpFPredicate.UNE, x, zero)
    return arith.cmpi(arith.CmpIPredicate.ne, x, zero)
  fs, fd = dtypes.is_float(src), dtypes.is_float(dst)
  if fs and fd:
    return (arith.extf(out, x) if dtypes.bits(dst) > dtypes.bits(src)
            else arith.truncf(out, x))
  if fs:
    return (arith.fptoui(out, x) if dtypes.is_unsigned(dst)
            else arith.fptosi(out, x))
  unsigned = dtypes.is_unsigned(src) or dtypes.is_bool(src)
  if fd:
    return arith.uitofp(out, x) if unsigned else arith.sitofp(out, x)
  sb, db = (1 if dtypes.is_bool(src) else dtypes.bits(src)), dtypes.bits(dst)
  if db > sb:
    return arith.extui(out, x) if unsigned else arith.extsi(out, x)
  if db < sb:
    return arith.trunci(out, x)
  return arith.bitcast(out, x)


@TABLE.register(lax.convert_element_type_p)
def _convert(ctx, x, *, new_dtype, **_):
  return convert(x, ctx.avals_in[0].dtype, new_dtype,
                 tuple(ctx.out_aval.shape))


@TABLE.register(lax.bitcast_convert_type_p)
def _bitcast(ctx, x, *, new_dtype):
  if dtypes.bits(ctx.avals_in[0].dtype) != dtypes.bits(new_dtype):
    raise ctx.error("bitcast between widths is not supported")
  return arith.bitcast(typed(shape_of(x), new_dtype), x)


@TABLE.register(primitives.multiple_of_p)
def _multiple_of(ctx, x, *, values):
  """`mosaic_gpu.assume_multiple` on scalars (layout inference proves a
  window's offset divisible with it), as Pallas's lowering does; vectors
  pass through."""
  if ctx.avals_in[0].shape:
    return x
  for multiple in values:
    x = mgpu.assume_multiple(x, multiple)
  return x


@TABLE.register(primitives.max_contiguous_p, lax.copy_p,
                custom_derivatives.stop_gradient_p)
def _identity(ctx, *xs, **_):
  return xs[0] if len(xs) == 1 and not ctx.eqn.primitive.multiple_results \
      else list(xs)


@TABLE.register(lax.optimization_barrier_p)
def _optimization_barrier(ctx, *xs):
  """`mosaic_gpu.optimization_barrier`: the kernel's values are computed
  before it and used after it, as the kernel orders them."""
  if not xs:
    return []
  out = mgpu.optimization_barrier(list(xs))
  return [out] if len(xs) == 1 else list(out)


@TABLE.register(getattr(lax, "square_p", None))
def _square(ctx, x, **_):
  mul = arith.mulf if dtypes.is_float(ctx.avals_in[0].dtype) else arith.muli
  return mul(x, x)
