"""Reductions (sum, max, min, prod, and, or, argmax, argmin) and cumulative
scans. Padded lanes are replaced by the reduction's identity first."""
from __future__ import annotations

import numpy as np
from jax import lax
from dsl.core.jax_internals import lax_control_flow as lax_cf

from lowering_triton import triton_dtypes as dtypes
from lowering_triton.codegen import paren
from lowering_triton.kernel_refs import bcast
from lowering_triton.rules import register
from lowering_triton.values import TVal, padded, pow2, py_literal


def lane_mask(shape, axes) -> str | None:
  """`True` on logical lanes of the padded axes among `axes`."""
  terms = []
  for ax in axes:
    n = shape[ax]
    if pow2(n) != n:
      terms.append(f"tl.arange(0, {pow2(n)}){bcast(ax, len(shape))} < {n}")
  if not terms:
    return None
  return " & ".join(f"({t})" if len(terms) > 1 else t for t in terms)


def fill_padding(ctx, expr: str, shape, axes, fill: str) -> str:
  mask = lane_mask(shape, axes)
  if mask is None:
    return expr
  return f"tl.where({mask}, {expr}, {fill})"


def _reduce_dtype(dtype):
  """The dtype a reduction of `dtype` is computed in."""
  dtype = np.dtype(dtype)
  if dtypes.is_low_float(dtype):
    return np.dtype(np.float32)
  if dtype == np.bool_ or (dtypes.is_int(dtype) and dtype.itemsize < 4):
    return np.dtype(np.int32) if not dtypes.is_unsigned(dtype) else \
        np.dtype(np.uint32)
  return dtype


def _input(ctx, x: TVal, cd) -> str:
  if x.dtype == cd:
    return x.expr
  return f"{paren(x.expr)}.to({dtypes.tl_type(cd)})"


def _reduce(ctx, x, axes, fn: str, identity, hint: str):
  out = ctx.out_aval
  cd = _reduce_dtype(x.dtype)
  expr = fill_padding(ctx, _input(ctx, x, cd), x.shape, axes,
                      py_literal(identity(cd), cd))
  for ax in sorted(axes, reverse=True):
    expr = fn.format(x=expr, axis=ax)
  if out.dtype == np.bool_:
    expr = f"{paren(expr)} != 0"
    cd = np.dtype(np.bool_)
  return ctx.finish(expr, out.shape, out.dtype, cd, hint=ctx.hint(hint))


@register(lax.reduce_sum_p)
def _sum(ctx, x, axes, **params):
  return _reduce(ctx, x, axes, "tl.sum({x}, axis={axis})", lambda d: 0, "sum")


# Float max/min propagate NaN, as jax.numpy does: `tl.max` keeps the number
# (the GPU's max.f32 drops NaN operands), so floats reduce with combine
# functions on `tl.maximum(..., propagate_nan=ALL)`.
_MAX_NAN_COMBINE = '''@triton.jit
def _max_nan_combine(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)'''

_MIN_NAN_COMBINE = '''@triton.jit
def _min_nan_combine(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)'''

# (value, index) pairs: the first NaN wins, then the larger (smaller) value,
# then the lower index, as jnp.argmax (argmin).
_ARG_NAN_COMBINE = '''@triton.jit
def {name}(value1, index1, value2, index2):
    nan1 = value1 != value1
    nan2 = value2 != value2
    tie = (value1 == value2) | (nan1 & nan2)
    first = (value1 {op} value2) | (nan1 & (value2 == value2)) | (tie & (index1 < index2))
    return tl.where(first, value1, value2), tl.where(first, index1, index2)'''

# Combine helper name -> the numpy reduction it computes: Triton's
# interpreter runs combine functions element by element, so the interpreter
# backend runs these with numpy instead (see interpret_backend).
NAN_REDUCTIONS = {"_max_nan_combine": "max", "_min_nan_combine": "min",
                  "_argmax_nan_combine": "argmax",
                  "_argmin_nan_combine": "argmin"}


def _nan_reduce(ctx, source: str, name: str) -> str:
  fn = ctx.host.need_helper(name, source)
  return "tl.reduce({x}, {axis}, " + fn + ")"


@register(lax.reduce_max_p)
def _max(ctx, x, axes, **params):
  fn = "tl.max({x}, axis={axis})"
  if dtypes.is_float(x.dtype):
    fn = _nan_reduce(ctx, _MAX_NAN_COMBINE, "_max_nan_combine")
  return _reduce(ctx, x, axes, fn, dtypes.min_value, "max")


@register(lax.reduce_min_p)
def _min(ctx, x, axes, **params):
  fn = "tl.min({x}, axis={axis})"
  if dtypes.is_float(x.dtype):
    fn = _nan_reduce(ctx, _MIN_NAN_COMBINE, "_min_nan_combine")
  return _reduce(ctx, x, axes, fn, dtypes.max_value, "min")


@register(lax.reduce_or_p)
def _any(ctx, x, axes, **params):
  return _reduce(ctx, x, axes, "tl.max({x}, axis={axis})", lambda d: 0, "any")


@register(lax.reduce_and_p)
def _all(ctx, x, axes, **params):
  return _reduce(ctx, x, axes, "tl.min({x}, axis={axis})", lambda d: 1, "all")


_MUL_COMBINE = '''@triton.jit
def _mul_combine(a, b):
    return a * b'''

_MAX_COMBINE = '''@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)'''

_MIN_COMBINE = '''@triton.jit
def _min_combine(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)'''


@register(lax.reduce_prod_p)
def _prod(ctx, x, axes, **params):
  fn = ctx.host.need_helper("_mul_combine", _MUL_COMBINE)
  return _reduce(ctx, x, axes, "tl.reduce({x}, {axis}, " + fn + ")",
                 lambda d: 1, "prod")


def _arg(ctx, x, axes, fn: str, op: str, identity, hint: str):
  (axis,) = axes
  out = ctx.out_aval
  cd = _reduce_dtype(x.dtype)
  expr = fill_padding(ctx, _input(ctx, x, cd), x.shape, [axis],
                      py_literal(identity(cd), cd))
  if not dtypes.is_float(cd):
    expr = f"tl.{fn}({expr}, axis={axis}, tie_break_left=True)"
    return ctx.finish(expr, out.shape, out.dtype, np.int32, hint=ctx.hint(hint))
  name = f"_{fn}_nan_combine"
  helper = ctx.host.need_helper(
      name, _ARG_NAN_COMBINE.format(name=name, op=op))
  values = ctx.bind_raw(expr, f"{hint}_values")
  shape = padded(x.shape)
  index = ctx.bind_raw(f"tl.broadcast_to(tl.arange(0, {shape[axis]})"
                       f"{bcast(axis, len(shape))}, {shape})", f"{hint}_index")
  expr = f"tl.reduce(({values}, {index}), {axis}, {helper})[1]"
  return ctx.finish(expr, out.shape, out.dtype, np.int32, hint=ctx.hint(hint))


@register(lax.argmax_p)
def _argmax(ctx, x, axes, index_dtype, **params):
  return _arg(ctx, x, axes, "argmax", ">", dtypes.min_value, "argmax")


@register(lax.argmin_p)
def _argmin(ctx, x, axes, index_dtype, **params):
  return _arg(ctx, x, axes, "argmin", "<", dtypes.max_value, "argmin")


def _cumulative(prim, template: str, identity, hint: str):
  @register(prim)
  def rule(ctx, x, axis, reverse=False, **params):
    out = ctx.out_aval
    cd = _reduce_dtype(x.dtype)
    expr = fill_padding(ctx, _input(ctx, x, cd), x.shape, [axis],
                        py_literal(identity(cd), cd))
    expr = template.format(x=expr, axis=axis, reverse=bool(reverse),
                           max=ctx.host.need_helper("_max_combine",
                                                        _MAX_COMBINE)
                           if "{max}" in template else "",
                           min=ctx.host.need_helper("_min_combine",
                                                        _MIN_COMBINE)
                           if "{min}" in template else "")
    return ctx.finish(expr, out.shape, out.dtype, cd, hint=ctx.hint(hint))
  return rule


_cumulative(lax_cf.cumsum_p, "tl.cumsum({x}, axis={axis}, reverse={reverse})",
            lambda d: 0, "cumsum")
_cumulative(lax_cf.cumprod_p, "tl.cumprod({x}, axis={axis}, reverse={reverse})",
            lambda d: 1, "cumprod")
_cumulative(lax_cf.cummax_p,
            "tl.associative_scan({x}, {axis}, {max}, reverse={reverse})",
            dtypes.min_value, "cummax")
_cumulative(lax_cf.cummin_p,
            "tl.associative_scan({x}, {axis}, {min}, reverse={reverse})",
            dtypes.max_value, "cummin")
