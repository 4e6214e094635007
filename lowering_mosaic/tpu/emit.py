"""Small MLIR builders shared by the lowering rules (value level).

Arrays of shape () are MLIR scalars; every other array is a `vector`.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from dsl.core.jax_internals import arith, ir, vector

from dsl.core.dtypes import bits, is_bool, is_float, is_unsigned  # noqa: F401
from lowering_mosaic import dialect
from lowering_mosaic.tpu.host import constant


def vtype(shape, dtype) -> ir.Type:
  return dialect.value_type(tuple(shape), dtype)


def is_vector(x: ir.Value) -> bool:
  return isinstance(x.type, ir.VectorType)


def broadcast_to(x: ir.Value, shape, dtype) -> ir.Value:
  """Scalars are splatted to `shape`; vectors of that shape pass through."""
  shape = tuple(shape)
  if shape == () or (is_vector(x) and
                     tuple(ir.VectorType(x.type).shape) == shape):
    return x
  return vector.BroadcastOp(vtype(shape, dtype), x).result


def reshape(x: ir.Value, from_shape, to_shape, dtype) -> ir.Value:
  """A shape cast that also goes to and from scalars."""
  from_shape, to_shape = tuple(from_shape), tuple(to_shape)
  if from_shape == to_shape:
    return x
  if to_shape == ():
    return vector.ExtractOp(x, [], [0] * len(from_shape)).result
  if from_shape == ():
    return vector.BroadcastOp(vtype(to_shape, dtype), x).result
  return vector.ShapeCastOp(vtype(to_shape, dtype), x).result


def zeros(shape, dtype) -> ir.Value:
  return constant(0, shape, dtype)


def convert(x: ir.Value, shape, src, dst) -> ir.Value:
  """`convert_element_type` between float, integer and bool types."""
  src, dst = jnp.dtype(src), jnp.dtype(dst)
  if src == dst:
    return x
  t = vtype(shape, dst)
  if is_bool(dst):
    zero = zeros(shape, src)
    if is_float(src):
      return arith.CmpFOp(arith.CmpFPredicate.UNE, x, zero).result
    return arith.CmpIOp(arith.CmpIPredicate.ne, x, zero).result
  if is_float(src) and is_float(dst):
    if bits(dst) > bits(src):
      return arith.ExtFOp(t, x).result
    if bits(dst) < bits(src):
      return arith.TruncFOp(t, x).result
    return arith.TruncFOp(t, arith.ExtFOp(vtype(shape, jnp.float32),
                                          x).result).result
  if is_float(src):        # float -> int
    return float_to_int(x, shape, src, dst)
  if is_float(dst):        # int -> float
    if is_unsigned(src) or is_bool(src):
      return arith.UIToFPOp(t, x).result
    return arith.SIToFPOp(t, x).result
  # int -> int
  if bits(dst) > bits(src):
    if is_unsigned(src) or is_bool(src):
      return arith.ExtUIOp(t, x).result
    return arith.ExtSIOp(t, x).result
  if bits(dst) < bits(src):
    return arith.TruncIOp(t, x).result
  return x                 # same width, signedness only


def float_to_int(x: ir.Value, shape, src, dst) -> ir.Value:
  """A float -> integer cast defined everywhere, as jax.numpy's on the CPU:
  truncation toward zero inside the range, saturation outside it, NaN -> 0.
  (`arith.fptosi`/`fptoui` give poison for NaN and out-of-range values.)"""
  if bits(src) < 32:
    src, x = jnp.dtype(jnp.float32), arith.ExtFOp(vtype(shape, jnp.float32),
                                                  x).result
  info = np.iinfo(np_dtype(dst))
  lo = constant(float(info.min), shape, src)          # -2**(b-1) or 0
  hi = constant(float(info.max) + 1.0, shape, src)    # 2**(b-1) or 2**b
  too_low = arith.CmpFOp(arith.CmpFPredicate.OLT, x, lo).result
  too_high = arith.CmpFOp(arith.CmpFPredicate.OGE, x, hi).result
  # NaN is neither too low nor too high, and is out of the range: it casts
  # the 0 that replaces every value out of the range.
  in_range = arith.AndIOp(
      arith.CmpFOp(arith.CmpFPredicate.OGE, x, lo).result,
      arith.CmpFOp(arith.CmpFPredicate.OLT, x, hi).result).result
  safe = select(in_range, x, zeros(shape, src))
  cast = arith.FPToUIOp if is_unsigned(dst) else arith.FPToSIOp
  r = cast(vtype(shape, dst), safe).result
  r = select(too_high, constant(int(info.max), shape, dst), r)
  return select(too_low, constant(int(info.min), shape, dst), r)


def select(pred, on_true, on_false) -> ir.Value:
  return arith.SelectOp(pred, on_true, on_false).result


def np_dtype(dtype):
  return np.dtype(jnp.dtype(dtype))
