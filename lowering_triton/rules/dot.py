"""`dot_general` as `tl.dot`.

Operands are permuted to `(batch?, M, K) x (batch?, K, N)`. Padded K lanes
are zeroed in both operands. Triton's `tl.dot` needs M, N and K of at least
16 (K of at least 32 for 8-bit operands): smaller dims are grown by
interleaving zero copies (`x[:, :, None]` broadcast and masked, then
reshaped), and the result is folded back to the real copy (`_fold`). Products are summed in the accumulator type (`out_dtype`:
int32 for int8 operands, float32 for floats), as on the GPU's tensor cores,
and rounded to the result type once. Dtypes without tensor-core dots
(int32, float64, ...) use an exact broadcast-multiply-sum.
"""
from __future__ import annotations

import numpy as np
from jax import lax

from lowering_triton import triton_dtypes as dtypes
from lowering_triton.codegen import paren
from lowering_triton.kernel_refs import bcast
from lowering_triton.rules import register
from lowering_triton.rules.shapes import reshape_value
from lowering_triton.values import TVal, padded, pow2

MIN_DOT = 16
_TC_DTYPES = {"float16", "bfloat16", "float32", "int8", "float8_e4m3fn",
              "float8_e5m2"}


def _permute(ctx, x: TVal, perm, hint) -> TVal:
  perm = tuple(perm)
  if perm == tuple(range(len(perm))):
    return x
  return ctx.bind(f"tl.permute({x.expr}, {perm})",
                  tuple(x.shape[p] for p in perm), x.dtype, hint)


def _insert_unit(ctx, x: TVal, axis: int, hint) -> TVal:
  shape = list(x.shape)
  shape.insert(axis, 1)
  return reshape_value(ctx, x, shape, hint)


def _zero_lanes(ctx, x: TVal, axis: int, hint) -> TVal:
  n = x.shape[axis]
  if pow2(n) == n:
    return x
  zero = "0" if not dtypes.is_float(x.dtype) else "0.0"
  expr = (f"tl.where(tl.arange(0, {pow2(n)}){bcast(axis, x.ndim)} < {n}, "
          f"{x.expr}, {zero})")
  return ctx.bind(expr, x.shape, x.dtype, hint)


def _grow(ctx, x: TVal, axis: int, factor: int, hint) -> tuple[str, tuple]:
  """`x` with `factor` interleaved copies of each lane of `axis`, all but
  the first zero. Returns the expression and its padded shape."""
  p = padded(x.shape)
  rank = len(p)
  idx = ", ".join([":"] * (axis + 1) + ["None"] + [":"] * (rank - axis - 1))
  expanded = list(p[:axis + 1]) + [factor] + list(p[axis + 1:])
  zero = "0" if not dtypes.is_float(x.dtype) else "0.0"
  first = f"tl.arange(0, {factor}){bcast(axis + 1, rank + 1)} == 0"
  grown = list(p)
  grown[axis] *= factor
  expr = (f"tl.reshape(tl.where({first}, tl.broadcast_to({paren(x.expr)}[{idx}], "
          f"{tuple(expanded)}), {zero}), {tuple(grown)})")
  return ctx.bind_raw(expr, hint), tuple(grown)


def default_matmul_precision() -> str:
  """jax_default_matmul_precision, for dots whose precision is None."""
  import jax
  return str(jax.config.jax_default_matmul_precision or "").lower()


def _input_precision(precision, dtype) -> str | None:
  """Triton's input_precision for a float32 dot: "ieee" for HIGHEST (or
  jax_default_matmul_precision=float32/highest), else "tf32" as XLA:GPU."""
  if np.dtype(dtype) != np.float32:
    return None
  values = precision if isinstance(precision, (tuple, list)) else (precision,)
  names = {str(getattr(p, "name", p)).upper() for p in values if p is not None}
  if not names:
    names = {default_matmul_precision().upper()}
  if names & {"HIGHEST", "FLOAT32"}:
    return "ieee"
  return "tf32"


@register(lax.dot_general_p)
def _dot_general(ctx, a, b, dimension_numbers, precision=None,
                 preferred_element_type=None, **params):
  (lc, rc), (lb, rb) = dimension_numbers
  lc, rc, lb, rb = map(list, (lc, rc, lb, rb))
  out = ctx.out_aval
  if len(lc) != 1 or len(lb) > 1:
    raise ctx.error(
        f"dot_general with {len(lc)} contracting and {len(lb)} batch dims is "
        "not supported by the Triton backend (one contracting dim and at most "
        "one batch dim are)")
  a_free = [d for d in range(a.ndim) if d not in lc + lb]
  b_free = [d for d in range(b.ndim) if d not in rc + rb]
  if len(a_free) > 1 or len(b_free) > 1:
    raise ctx.error("dot_general with more than one free dim per operand is "
                    "not supported by the Triton backend; reshape to 2-D first")
  if a.literal is not None or b.literal is not None:
    raise ctx.error("dot_general of a constant scalar is not supported")
  a3 = _permute(ctx, a, lb + a_free + lc, "lhs")
  b3 = _permute(ctx, b, rb + rc + b_free, "rhs")
  nb = len(lb)
  if not a_free:
    a3 = _insert_unit(ctx, a3, nb, "lhs")
  if not b_free:
    b3 = _insert_unit(ctx, b3, nb + 1, "rhs")
  # Operand dtypes: promote mixed inputs to the wider one.
  in_dtype = np.promote_types(a.dtype, b.dtype) if a.dtype != b.dtype else \
      np.dtype(a.dtype)
  if a3.dtype != in_dtype:
    a3 = ctx.bind(ctx.cast_expr(a3, in_dtype), a3.shape, in_dtype, "lhs")
  if b3.dtype != in_dtype:
    b3 = ctx.bind(ctx.cast_expr(b3, in_dtype), b3.shape, in_dtype, "rhs")
  m, k = a3.shape[-2], a3.shape[-1]
  n = b3.shape[-1]
  a3 = _zero_lanes(ctx, a3, a3.ndim - 1, "lhs")
  b3 = _zero_lanes(ctx, b3, b3.ndim - 2, "rhs")
  out_dtype = np.dtype(out.dtype)
  if in_dtype.name in _TC_DTYPES:
    acc = np.dtype(np.int32) if dtypes.is_int(in_dtype) else np.dtype(np.float32)
    result_shape = a3.shape[:-1] + (n,)
    expr = _tc_dot(ctx, a3, b3, m, n, k, acc, precision)
  else:
    acc = dtypes.compute_dtype(out_dtype)
    if acc == np.bool_:
      acc = np.dtype(np.int32)
    rank = a3.ndim
    lhs = ctx.cast_expr(a3, acc) if a3.dtype != acc else a3.expr
    rhs = ctx.cast_expr(b3, acc) if b3.dtype != acc else b3.expr
    idx_a = ", ".join([":"] * rank + ["None"])
    idx_b = ", ".join([":"] * (rank - 2) + ["None", ":", ":"])
    expr = f"tl.sum({paren(lhs)}[{idx_a}] * {paren(rhs)}[{idx_b}], axis={rank - 1})"
    result_shape = a3.shape[:-1] + (n,)
  res = ctx.finish(expr, result_shape, out_dtype, acc if out_dtype != np.bool_
                   else np.bool_, hint=ctx.hint("dot"))
  if tuple(res.shape) != tuple(out.shape):
    res = reshape_value(ctx, res, out.shape, ctx.hint("dot"))
  return res


def _tc_dot(ctx, a3: TVal, b3: TVal, m: int, n: int, k: int, acc, precision):
  pm, pn, pk = pow2(m), pow2(n), pow2(k)
  lhs, rhs = a3.expr, b3.expr
  note = []
  # 8-bit operands (int8, fp8) need K >= 32.
  min_k = 2 * MIN_DOT if np.dtype(a3.dtype).itemsize == 1 else MIN_DOT
  if pk < min_k:
    note.append(f"K {k}->{min_k}")
    lhs, _ = _grow(ctx, a3, a3.ndim - 1, min_k // pk, "lhs_k")
    rhs, _ = _grow(ctx, b3, b3.ndim - 2, min_k // pk, "rhs_k")
    a3 = TVal(lhs, a3.shape[:-1] + (min_k,), a3.dtype)
    b3 = TVal(rhs, b3.shape[:-2] + (min_k,) + b3.shape[-1:], b3.dtype)
  fm = MIN_DOT // pm if pm < MIN_DOT else 1
  fn = MIN_DOT // pn if pn < MIN_DOT else 1
  if fm > 1:
    note.append(f"M {m}->{MIN_DOT}")
    lhs, _ = _grow(ctx, a3, a3.ndim - 2, fm, "lhs_m")
  if fn > 1:
    note.append(f"N {n}->{MIN_DOT}")
    rhs, _ = _grow(ctx, b3, b3.ndim - 1, fn, "rhs_n")
  if note:
    dims = (f"M, N, K >= {MIN_DOT}" if min_k == MIN_DOT else
            f"M, N >= {MIN_DOT}, K >= {min_k}")
    ctx.emit(f"# tl.dot needs {dims}: padded {', '.join(note)} with zeros")
  kwargs = [f"out_dtype={dtypes.tl_type(acc)}"]
  prec = _input_precision(precision, a3.dtype)
  if prec is not None:
    kwargs.append(f"input_precision=\"{prec}\"")
  expr = f"tl.dot({lhs}, {rhs}, {', '.join(kwargs)})"
  if fm > 1 or fn > 1:
    batch = tuple(padded(a3.shape[:-2]))
    expr = ctx.bind_raw(expr, "dot_padded")
    if fm > 1:
      expr = _fold(expr, batch + (pm, fm, pn * fn), len(batch) + 1, acc)
    if fn > 1:
      expr = _fold(expr, batch + (pm, pn, fn), len(batch) + 2, acc)
  return expr


def _fold(expr: str, shape: tuple, axis: int, acc) -> str:
  """The first of the copies along `axis` of `expr` reshaped to `shape`:
  the others multiplied zeros with the other operand, which gives NaN
  where it holds inf or NaN, so they are replaced by -0.0 (0 for
  integers), which adds nothing to any value, before the copies are
  summed."""
  rank = len(shape)
  zero = "-0.0" if dtypes.is_float(acc) else "0"
  first = f"tl.arange(0, {shape[axis]}){bcast(axis, rank)} == 0"
  return (f"tl.sum(tl.where({first}, tl.reshape({expr}, {shape}), {zero}), "
          f"axis={axis})")
