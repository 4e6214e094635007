"""The walker's host for the Mosaic GPU lowering, and value helpers.

A lowered value is an MLIR value: a scalar (`i32`, `f32`, ...), a vector
(`vector<128x64xf32>`, one per warpgroup; the library's layout inference
decides how its elements are spread over the 128 threads), or a shared-memory
`memref` (a ref: an operand's block, a scratch buffer).
"""
from __future__ import annotations

import contextlib
import math
import dataclasses
from typing import Any

import numpy as np
from jax._src import core
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, vector
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from dsl import dtypes
from dsl.errors import BackendError, source_info_frame
from dsl.jaxpr_walk import LoweringHost, RuleTable, walk_jaxpr

TABLE = RuleTable("the Mosaic GPU backend")

TRITON_HINT = "; use backend='triton' for this kernel"


def ir_type(dtype) -> ir.Type:
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return ir.IntegerType.get_signless(1)
  return mgpu_utils.dtype_to_ir_type(dtype)


def is_vector(v) -> bool:
  return isinstance(v.type, ir.VectorType)


def is_ref(v) -> bool:
  return isinstance(v.type, ir.MemRefType)


def shape_of(v) -> tuple[int, ...]:
  if is_vector(v):
    return tuple(ir.VectorType(v.type).shape)
  return ()


def elem_type(v) -> ir.Type:
  return ir.VectorType(v.type).element_type if is_vector(v) else v.type


def typed(shape, dtype) -> ir.Type:
  t = dtype if isinstance(dtype, ir.Type) else ir_type(dtype)
  return ir.VectorType.get(list(shape), t) if shape else t


def scalar_constant(value, dtype) -> ir.Value:
  dtype = np.dtype(dtype)
  t = ir_type(dtype)
  if dtypes.is_float(dtype):
    return arith.constant(t, ir.FloatAttr.get(t, float(value)))
  if dtype == np.bool_:
    return arith.constant(t, ir.IntegerAttr.get(t, int(bool(value))))
  v = int(value)
  if dtypes.is_unsigned(dtype) and v >= 1 << (dtype.itemsize * 8 - 1):
    v -= 1 << (dtype.itemsize * 8)
  return arith.constant(t, ir.IntegerAttr.get(t, v))


def constant(value, shape, dtype) -> ir.Value:
  """A scalar or a splat vector; a vector of distinct values cannot be
  distributed over a warpgroup by the library."""
  arr = np.asarray(value)
  if arr.size and not np.all(arr == arr.reshape(-1)[0]):
    raise ValueError("array constants with distinct elements are not "
                     "supported (only splats); compute them with iota")
  s = scalar_constant(arr.reshape(-1)[0] if arr.size else 0, dtype)
  return broadcast_to(s, tuple(shape))


def broadcast_to(v, shape: tuple[int, ...]) -> ir.Value:
  """A scalar `v` splatted to `shape` (vectors are returned unchanged)."""
  if not shape or is_vector(v):
    return v
  return vector.broadcast(ir.VectorType.get(list(shape), v.type), v)


def reshape(x, shape, dtype) -> ir.Value:
  """`x` with its elements laid out as `shape` (same element count)."""
  shape = tuple(shape)
  if shape_of(x) == shape:
    return x
  if not is_vector(x):
    return broadcast_to(x, shape)
  if not shape:
    return vector.extract(x, [], [0] * len(shape_of(x)))
  # Look through an earlier reshape (the unit dims of keepdims results
  # come and go): the library has no register layout for (n, 1) vectors.
  op = getattr(getattr(x, "owner", None), "opview", None)
  if op is not None and op.operation.name == "vector.shape_cast":
    src = op.operands[0]
    if shape_of(src) == shape:
      return src
  return vector.shape_cast(typed(shape, dtype), x)


def broadcast_in_dim(x, shape, dims, dtype) -> ir.Value:
  """`x` broadcast to `shape`, its dim i becoming dim `dims[i]`; unit dims
  that grow are dropped first (the library broadcasts along new dims)."""
  from jax._src.lib import mosaic_gpu_dialect as mgpu
  shape = tuple(shape)
  if not is_vector(x):
    return broadcast_to(x, shape)
  in_shape = shape_of(x)
  if math.prod(in_shape) == math.prod(shape):   # only unit dims are added
    return reshape(x, shape, dtype)
  keep = [i for i, d in enumerate(in_shape)
          if not (d == 1 and shape[dims[i]] != 1)]
  kept = [in_shape[i] for i in keep]
  if len(keep) != len(in_shape):
    x = reshape(x, kept, dtype)
  if not kept:
    return broadcast_to(x, shape)
  if tuple(kept) == shape:
    return x
  return mgpu.broadcast_in_dim(typed(shape, dtype), x,
                               [dims[i] for i in keep])


def to_shape(x, shape, dtype) -> ir.Value:
  """`x` broadcast numpy-style (size-1 and leading dims) to `shape`."""
  shape = tuple(shape)
  if not is_vector(x):
    return broadcast_to(x, shape)
  in_shape = shape_of(x)
  if in_shape == shape:
    return x
  offset = len(shape) - len(in_shape)
  return broadcast_in_dim(x, shape, list(range(offset, len(shape))), dtype)


def i32(v: int) -> ir.Value:
  return scalar_constant(v, np.int32)


def index_cast_i32(v) -> ir.Value:
  t = ir.IntegerType.get_signless(32)
  if isinstance(v.type, ir.IndexType):
    return arith.index_cast(t, v)
  if ir.IntegerType(v.type).width != 32:
    return arith.trunci(t, v) if ir.IntegerType(v.type).width > 32 else \
        arith.extsi(t, v)
  return v


def to_index(v) -> ir.Value:
  if isinstance(v.type, ir.IndexType):
    return v
  return arith.index_cast(ir.IndexType.get(), v)


@dataclasses.dataclass
class RuleContext:
  host: "GpuHost"
  eqn: Any
  avals_in: list
  avals_out: list
  used_out: list

  def error(self, message: str) -> BackendError:
    return self.host.error(message, self.eqn)

  def lower(self, jaxpr: core.Jaxpr, consts, args) -> list:
    return walk_jaxpr(self.host, jaxpr, consts, args)


class GpuHost(LoweringHost):
  """Lowers one kernel's jaxprs at the current insertion point."""
  rules = TABLE

  def __init__(self, kernel: str, where: str | None):
    self.kernel = kernel
    self.where = where
    self.scoped = {}        # id(run_scoped equation) -> its SMEM buffers

  def literal(self, atom):
    return self._constant(atom.val, atom.aval)

  def constvar(self, var, value):
    if isinstance(value, ir.Value):
      return value
    return self._constant(np.asarray(value), var.aval)

  def _constant(self, value, aval):
    try:
      return constant(value, aval.shape, aval.dtype)
    except ValueError as e:
      raise self.error(f"{e}{TRITON_HINT}") from e

  def rule_context(self, eqn, used, position):
    return RuleContext(self, eqn, [v.aval for v in eqn.invars],
                       [v.aval for v in eqn.outvars],
                       [v in used for v in eqn.outvars])

  def error(self, message, eqn=None):
    line = source_info_frame(eqn.source_info) if eqn is not None else None
    return BackendError(self.kernel, message, line or self.where)

  def unsupported(self, eqn):
    return self.error(
        f"primitive '{eqn.primitive.name}' is not supported by "
        f"{self.rules.owner} (it has no lowering rule there)" + TRITON_HINT
        + " (or backend='interpret' off the GPU)", eqn)

  @contextlib.contextmanager
  def lowering_eqn(self, eqn):
    line = source_info_frame(eqn.source_info)
    if line and ":" in line:
      path, _, num = line.rpartition(":")
      loc = ir.Location.file(path, int(num) if num.isdigit() else 0, 0)
      with ir.Location.name(eqn.primitive.name, childLoc=loc):
        yield
    else:
      yield
