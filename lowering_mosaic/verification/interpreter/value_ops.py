"""numpy meaning of the pure (value) ops: arith, math, vector, tpu vectors.

`VALUE_OPS.lookup(name)(op) -> fn(*operand values) -> result` reads the op's
attributes once; the returned function runs on numpy values (numpy scalars
for MLIR scalars, arrays for vectors).
"""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import scipy.special
from dsl.core.jax_internals import ir

from dsl.core.jaxpr_walk import RuleTable
from dsl.core.poison import poison_value
from lowering_mosaic import dialect

VALUE_OPS = RuleTable("the Mosaic interpreter")
value_op = VALUE_OPS.register


def result_dtype(op, k: int = 0):
  t = op.results[k].type
  if isinstance(t, ir.VectorType):
    return dialect.numpy_dtype(t.element_type)
  return dialect.numpy_dtype(t)


def result_shape(op, k: int = 0):
  t = op.results[k].type
  if isinstance(t, ir.VectorType):
    return tuple(t.shape)
  return ()


def _as(x, dtype):
  """numpy value of dtype (0-d arrays become numpy scalars)."""
  a = np.asarray(x).astype(dtype, copy=False)
  return a[()] if a.ndim == 0 else a


def int_attr(op, name, default=None):
  if name not in op.attributes:
    return default
  return ir.IntegerAttr(op.attributes[name]).value


def i64_array_attr(op, name):
  a = op.attributes[name]
  try:
    return [int(x) for x in ir.DenseI64ArrayAttr(a)]
  except (ValueError, TypeError):
    pass
  try:
    return [int(x) for x in ir.DenseI32ArrayAttr(a)]
  except (ValueError, TypeError):
    pass
  return [ir.IntegerAttr(x).value for x in ir.ArrayAttr(a)]


# ------------------------------------------------------------ constants

def _attr_value(attr, shape, dtype):
  if isinstance(attr, ir.DenseElementsAttr):
    d = ir.DenseElementsAttr(attr)
    if d.is_splat:
      v = _attr_value(d.get_splat_value(), (), dtype)
      return np.full(shape, v, dtype)
    if dtype == np.bool_:
      return np.array(ir.DenseIntElementsAttr(attr), dtype=np.int64).astype(
          bool).reshape(shape)
    try:
      arr = np.array(ir.DenseFPElementsAttr(attr))
    except (ValueError, TypeError):
      arr = np.array(ir.DenseIntElementsAttr(attr))
    return arr.astype(dtype).reshape(shape)
  if isinstance(attr, ir.FloatAttr):
    return _as(ir.FloatAttr(attr).value, dtype)
  v = ir.IntegerAttr(attr).value
  if dtype == np.bool_:
    return np.bool_(v != 0)
  return _as(np.array(v).astype(np.int64), dtype) if dtype != np.int64 \
      else int(v)


@value_op("arith.constant")
def _constant(op):
  dtype, shape = result_dtype(op), result_shape(op)
  val = _attr_value(op.attributes["value"], shape, dtype)
  if isinstance(op.results[0].type, ir.IndexType):
    val = int(val)
  return lambda: val


# ------------------------------------------------------------ arith

def _binary(fn):
  def make(op):
    dtype = result_dtype(op)
    return lambda a, b: _as(fn(a, b), dtype)
  return make


def _signed(dtype):
  return np.dtype(f"int{dtype.itemsize * 8}") if dtype != np.bool_ else dtype


def _unsigned(dtype):
  return np.dtype(f"uint{dtype.itemsize * 8}") if dtype != np.bool_ else dtype


def _as_unsigned(fn):
  def make(op):
    dtype = np.dtype(result_dtype(op))
    u = _unsigned(dtype)

    def run(a, b):
      r = fn(np.asarray(a).view(u) if np.ndim(a) else np.asarray(a).astype(
          dtype).view(u), np.asarray(b).view(u) if np.ndim(b) else
          np.asarray(b).astype(dtype).view(u))
      return _as(np.asarray(r).astype(u).view(dtype), dtype)
    return run
  return make


class UndefinedOperation(ValueError):
  """An operation whose result `arith` leaves undefined (immediate UB)."""


def _int_div(a, b):
  a, b = _check_division(a, b, "division")
  q = np.trunc(np.true_divide(a, b))
  return q.astype(a.dtype)


def _int_rem(a, b):
  a, b = _check_division(a, b, "remainder")
  return np.fmod(a, b)


def _check_division(a, b, what, signed=True):
  """The lowering guards divisors; an unguarded 0 (or INT_MIN / -1) means
  the module computes something a TPU does not define."""
  a, b = np.asarray(a), np.asarray(b)
  if np.any(b == 0):
    raise UndefinedOperation(f"integer {what} by zero is undefined")
  if signed and np.any((b == -1) & (a == np.iinfo(a.dtype).min)):
    raise UndefinedOperation(f"integer {what} of the minimum by -1 "
                             "overflows (undefined)")
  return a, b


def _unsigned_div(fn, what):
  def run(a, b):
    _check_division(a, b, what, signed=False)
    return fn(a, b)
  return run


def _maximumf(a, b):
  """arith.maximumf (IEEE 754-2019 maximum): NaN propagates, -0 < +0."""
  a, b = np.asarray(a), np.asarray(b)
  tie = a == b
  return np.where(tie, np.where(np.signbit(a), b, a), np.maximum(a, b))


def _minimumf(a, b):
  """arith.minimumf (IEEE 754-2019 minimum): NaN propagates, -0 < +0."""
  a, b = np.asarray(a), np.asarray(b)
  tie = a == b
  return np.where(tie, np.where(np.signbit(a), a, b), np.minimum(a, b))


for _n, _f in [("arith.addf", np.add), ("arith.subf", np.subtract),
               ("arith.mulf", np.multiply), ("arith.divf", np.true_divide),
               ("arith.remf", np.fmod), ("arith.maximumf", _maximumf),
               ("arith.minimumf", _minimumf), ("arith.addi", np.add),
               ("arith.subi", np.subtract), ("arith.muli", np.multiply),
               ("arith.divsi", _int_div), ("arith.remsi", _int_rem),
               ("arith.maxsi", np.maximum), ("arith.minsi", np.minimum),
               ("arith.andi", np.bitwise_and), ("arith.ori", np.bitwise_or),
               ("arith.xori", np.bitwise_xor), ("math.powf", np.power),
               ("math.atan2", np.arctan2)]:
  value_op(_n)(_binary(_f))

for _n, _f in [("arith.divui", _unsigned_div(np.floor_divide, "division")),
               ("arith.remui", _unsigned_div(np.mod, "remainder")),
               ("arith.maxui", np.maximum), ("arith.minui", np.minimum)]:
  value_op(_n)(_as_unsigned(_f))


def _shift(kind):
  """Shifts; an amount out of [0, width) gives poison in `arith` (the
  lowering guards every amount), shown as the dtype's poison value."""
  def make(op):
    dtype = np.dtype(result_dtype(op))
    bits = dtype.itemsize * 8
    u = _unsigned(dtype)

    def run(a, b):
      a = np.asarray(a).astype(dtype)
      b = np.asarray(b).astype(np.int64)
      big = (b < 0) | (b >= bits)
      b = np.where(big, 0, b)
      if kind == "shl":
        r = np.left_shift(a.view(u), b.astype(u)).view(dtype)
      elif kind == "shrs":
        r = np.right_shift(a, b.astype(dtype))
      else:
        r = np.right_shift(a.view(u), b.astype(u)).view(dtype)
      return _as(np.where(big, poison_value(dtype), r), dtype)
    return run
  return make


value_op("arith.shli")(_shift("shl"))
value_op("arith.shrsi")(_shift("shrs"))
value_op("arith.shrui")(_shift("shru"))


@value_op("arith.negf")
def _negf(op):
  dtype = result_dtype(op)
  return lambda a: _as(np.negative(a), dtype)


_ICMP = {0: np.equal, 1: np.not_equal, 2: np.less, 3: np.less_equal,
         4: np.greater, 5: np.greater_equal}


@value_op("arith.cmpi")
def _cmpi(op):
  pred = int_attr(op, "predicate")
  if pred < 6:
    fn = _ICMP[pred]
    return lambda a, b: _as(fn(a, b), np.bool_)
  fn = _ICMP[pred - 4]
  dtype = dialect.numpy_dtype(op.operands[0].type.element_type if isinstance(
      op.operands[0].type, ir.VectorType) else op.operands[0].type)
  u = _unsigned(np.dtype(dtype))
  return lambda a, b: _as(fn(np.asarray(a).astype(dtype).view(u),
                              np.asarray(b).astype(dtype).view(u)), np.bool_)


def _fcmp(pred):
  ordered = {1: np.equal, 2: np.greater, 3: np.greater_equal, 4: np.less,
             5: np.less_equal, 6: np.not_equal}
  if pred == 0:
    return lambda a, b: np.zeros(np.broadcast(a, b).shape, bool)
  if pred == 15:
    return lambda a, b: np.ones(np.broadcast(a, b).shape, bool)
  if pred == 7:
    return lambda a, b: ~(np.isnan(a) | np.isnan(b))
  if pred == 14:
    return lambda a, b: np.isnan(a) | np.isnan(b)
  if pred in ordered:
    f = ordered[pred]
    return lambda a, b: f(a, b) & ~(np.isnan(a) | np.isnan(b))
  f = ordered[pred - 7]
  return lambda a, b: f(a, b) | np.isnan(a) | np.isnan(b)


@value_op("arith.cmpf")
def _cmpf(op):
  fn = _fcmp(int_attr(op, "predicate"))
  with np.errstate(invalid="ignore"):
    return lambda a, b: _as(fn(np.asarray(a, np.float32),
                               np.asarray(b, np.float32)), np.bool_)


@value_op("arith.select")
def _select(op):
  dtype = result_dtype(op)
  return lambda c, a, b: _as(np.where(c, a, b), dtype)


def _cast(kind):
  def make(op):
    dtype = np.dtype(result_dtype(op))
    src_t = op.operands[0].type
    src = dialect.numpy_dtype(src_t.element_type if isinstance(
        src_t, ir.VectorType) else src_t)
    if kind == "ext_u":
      return lambda a: _as(np.asarray(a).astype(src).view(_unsigned(
          np.dtype(src))) if src != np.bool_ else np.asarray(a), dtype)
    if kind in ("fp_to_si", "fp_to_ui"):
      # NaN and values out of the range give poison in `arith` (the
      # lowering guards every cast), shown as the dtype's poison value.
      info = np.iinfo(_unsigned(dtype) if kind == "fp_to_ui" else dtype)

      def run(a):
        a = np.trunc(np.asarray(a, np.float64))
        bad = ~((a >= info.min) & (a <= info.max))      # NaN included
        r = np.where(bad, 0, a).astype(info.dtype).view(dtype)
        return _as(np.where(bad, poison_value(dtype), r), dtype)
      return run
    if kind == "ui_to_fp":
      return lambda a: _as(np.asarray(a).astype(src).view(_unsigned(
          np.dtype(src))) if src != np.bool_ else np.asarray(a), dtype)
    if kind == "bitcast":
      return lambda a: _as(np.asarray(a).astype(src).view(dtype), dtype)
    if kind == "index":
      if isinstance(op.results[0].type, ir.IndexType):
        return lambda a: int(a)
      return lambda a: _as(np.int64(a), dtype)
    return lambda a: _as(a, dtype)
  return make


for _n in ("arith.extf", "arith.truncf", "arith.extsi", "arith.trunci",
           "arith.sitofp", "tpu.extf", "tpu.truncf"):
  value_op(_n)(_cast("plain"))
value_op("arith.extui")(_cast("ext_u"))
value_op("arith.uitofp")(_cast("ui_to_fp"))
value_op("arith.fptosi")(_cast("fp_to_si"))
value_op("arith.fptoui")(_cast("fp_to_ui"))
value_op("arith.bitcast")(_cast("bitcast"))
value_op("arith.index_cast", "arith.index_castui")(_cast("index"))


# ------------------------------------------------------------ math

def _unary(fn):
  def make(op):
    dtype = result_dtype(op)
    return lambda a: _as(fn(np.asarray(a, np.float32)
                            if np.dtype(dtype).kind == "f" else
                            np.asarray(a)), dtype)
  return make


for _n, _f in [("math.exp", np.exp), ("math.exp2", np.exp2),
               ("math.log", np.log), ("math.log1p", np.log1p),
               ("math.expm1", np.expm1), ("math.sqrt", np.sqrt),
               ("math.rsqrt", lambda x: 1.0 / np.sqrt(x)),
               ("math.cbrt", np.cbrt), ("math.tanh", np.tanh),
               ("math.sin", np.sin), ("math.cos", np.cos),
               ("math.tan", np.tan), ("math.erf", scipy.special.erf),
               ("math.floor", np.floor), ("math.ceil", np.ceil),
               ("math.absf", np.abs), ("math.absi", np.abs),
               ("math.roundeven", np.rint),
               ("math.round", lambda x: np.trunc(x + np.copysign(0.5, x))),
               ("tpu.logistic", lambda x: 1.0 / (1.0 + np.exp(-x)))]:
  value_op(_n)(_unary(_f))


@value_op("math.isfinite")
def _isfinite(op):
  return lambda a: _as(np.isfinite(np.asarray(a, np.float32)), np.bool_)


# ------------------------------------------------------------ vector

@value_op("vector.broadcast")
def _broadcast(op):
  shape, dtype = result_shape(op), result_dtype(op)
  return lambda a: np.broadcast_to(np.asarray(a, dtype), shape).copy()


@value_op("vector.shape_cast")
def _shape_cast(op):
  shape = result_shape(op)
  return lambda a: np.asarray(a).reshape(shape)


@value_op("vector.extract")
def _extract(op):
  pos = [int(p) for p in ir.DenseI64ArrayAttr(op.attributes["static_position"])]
  n_dyn = len(op.operands) - 1
  dtype = result_dtype(op)

  def run(a, *dyn):
    dyn = iter(dyn)
    idx = tuple(int(next(dyn)) if p < 0 else p for p in pos)
    return _as(np.asarray(a)[idx], dtype)
  del n_dyn
  return run


@value_op("vector.extract_strided_slice")
def _extract_strided(op):
  offs = i64_array_attr(op, "offsets")
  sizes = i64_array_attr(op, "sizes")
  strides = i64_array_attr(op, "strides")
  idx = tuple(slice(o, o + s * st, st) for o, s, st in zip(offs, sizes,
                                                             strides))
  return lambda a: np.asarray(a)[idx].copy()


_KIND = re.compile(r"#vector\.kind<(\w+)>")


def _signed_zero_fix(red, src, dims, kind):
  """np.max/np.min pick either zero of a -0/+0 tie; maximumf wants +0 and
  minimumf -0 when the reduced lanes hold both."""
  if kind == "maximumf":      # +0 if any lane holds +0
    has_pos = np.any((src == 0) & ~np.signbit(src), axis=dims)
    zero = np.where(has_pos, 0.0, -0.0)
  else:                       # -0 if any lane holds -0
    has_neg = np.any((src == 0) & np.signbit(src), axis=dims)
    zero = np.where(has_neg, -0.0, 0.0)
  return np.where(red == 0, zero.astype(src.dtype), red)


@value_op("vector.multi_reduction")
def _multi_reduction(op):
  kind = _KIND.search(str(op.attributes["kind"])).group(1)
  dims = tuple(i64_array_attr(op, "reduction_dims"))
  dtype = result_dtype(op)
  combine = {"add": np.add, "mul": np.multiply, "maximumf": _maximumf,
             "minimumf": _minimumf, "maxsi": np.maximum, "minsi": np.minimum,
             "maxui": np.maximum, "minui": np.minimum,
             "and": np.bitwise_and, "or": np.bitwise_or}[kind]
  acc_float = np.dtype(dtype).kind == "f"

  def run(src, acc):
    src = np.asarray(src)
    if kind in ("maxui", "minui"):
      u = _unsigned(src.dtype)
      red = (np.max if kind == "maxui" else np.min)(src.view(u), axis=dims)
      acc = np.asarray(acc).astype(dtype).view(u)
      return _as(np.asarray(combine(red, acc)).astype(u).view(dtype), dtype)
    if kind in ("and", "or"):
      red = combine.reduce(src, axis=dims)
    elif kind in ("add", "mul") and acc_float:
      red = (np.sum if kind == "add" else np.prod)(
          src.astype(np.float32), axis=dims)
    elif kind in ("add", "mul"):
      red = (np.sum if kind == "add" else np.prod)(src, axis=dims)
    else:
      red = (np.max if "max" in kind else np.min)(src, axis=dims)
      if kind in ("maximumf", "minimumf"):
        red = _signed_zero_fix(red, src, dims, kind)
    return _as(combine(np.asarray(red).astype(dtype), acc), dtype)
  return run


# ------------------------------------------------------------ tpu vectors

_DN = re.compile(r"<\[([^\]]*)\], \[([^\]]*)\], \[([^\]]*)\], \[([^\]]*)\], "
                 r"\[([^\]]*)\], \[([^\]]*)\], \[([^\]]*)\]>")


def _ints(s):
  return [int(x) for x in s.split(",") if x.strip()]


@value_op("tpu.matmul")
def _matmul(op):
  dtype = result_dtype(op)
  m = _DN.search(str(op.attributes["dimension_numbers"]))
  lc, rc, lnc, rnc, order, lb, rb = (_ints(g) for g in m.groups())
  float_out = np.dtype(dtype).kind == "f"

  def run(lhs, rhs, acc):
    lhs, rhs = np.asarray(lhs), np.asarray(rhs)
    work = np.float32 if float_out else np.int64
    lhs, rhs = lhs.astype(work), rhs.astype(work)
    lhs = np.transpose(lhs, lb + lnc + lc)
    rhs = np.transpose(rhs, rb + rc + rnc)
    nb = len(lb)
    bshape = lhs.shape[:nb]
    lhs = lhs.reshape(bshape + (int(np.prod(lhs.shape[nb:nb + len(lnc)])),
                                int(np.prod(lhs.shape[nb + len(lnc):]))))
    rhs2 = rhs.reshape(bshape + (int(np.prod(rhs.shape[nb:nb + len(rc)])),
                                 int(np.prod(rhs.shape[nb + len(rc):]))))
    out = np.matmul(lhs, rhs2)
    out = out.reshape(np.asarray(acc).shape)
    return _as(out + np.asarray(acc).astype(work), dtype)
  return run


@value_op("tpu.iota")
def _iota(op):
  shape, dtype = result_shape(op), result_dtype(op)
  dims = i64_array_attr(op, "dimensions")
  (d,) = dims
  val = np.broadcast_to(
      np.arange(shape[d]).reshape([-1 if k == d else 1 for k in
                                   range(len(shape))]), shape).astype(dtype)
  return lambda: val.copy()


@value_op("tpu.transpose")
def _transpose(op):
  perm = i64_array_attr(op, "permutation")
  return lambda a: np.ascontiguousarray(np.transpose(a, perm))


@value_op("tpu.concatenate")
def _concatenate(op):
  d = int_attr(op, "dimension")
  return lambda *xs: np.concatenate([np.asarray(x) for x in xs], axis=d)


@value_op("tpu.dynamic_rotate")
def _rotate(op):
  dim = int_attr(op, "dimension")
  stride = int_attr(op, "stride")
  stride_dim = int_attr(op, "stride_dimension")

  def run(x, amount):
    x = np.asarray(x)
    if stride is None:
      return np.roll(x, int(amount), dim)
    rows = [np.roll(np.take(x, [k], axis=stride_dim), int(amount) + k *
                    stride, dim) for k in range(x.shape[stride_dim])]
    return np.concatenate(rows, axis=stride_dim)
  return run


@value_op("tpu.repeat")
def _repeat(op):
  dim, times = int_attr(op, "dimension"), int_attr(op, "times")

  def run(x):
    x = np.asarray(x)
    reps = [1] * x.ndim
    reps[dim] = times
    return np.tile(x, reps)
  return run


@value_op("tpu.bitcast")
def _bitcast(op):
  shape, dtype = result_shape(op), np.dtype(result_dtype(op))

  def run(x):
    x = np.ascontiguousarray(np.asarray(x))
    src_bits, dst_bits = x.dtype.itemsize * 8, dtype.itemsize * 8
    if src_bits == dst_bits:
      return x.view(dtype)
    if src_bits > dst_bits:   # [.., M, N] -> [.., M*r, N]
      r = src_bits // dst_bits
      y = x.view(dtype).reshape(x.shape + (r,))          # [.., M, N, r]
      return np.ascontiguousarray(np.moveaxis(y, -1, -2)).reshape(shape)
    r = dst_bits // src_bits
    y = x.reshape(x.shape[:-2] + (x.shape[-2] // r, r, x.shape[-1]))
    y = np.ascontiguousarray(np.moveaxis(y, -2, -1))     # [.., M, N, r]
    return y.view(dtype).reshape(shape)
  return run


@value_op("tpu.assume_multiple")
def _assume_multiple(op):
  return lambda x: x


del ml_dtypes
