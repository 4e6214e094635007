"""Broadcasts, reshapes, iota and reductions."""
from __future__ import annotations

import math

import numpy as np
from jax import lax
from dsl.core.jax_internals import ir, mosaic_gpu_dialect as mgpu, nvvm, vector
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.mosaic.gpu import layouts
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from dsl.core import dtypes
from lowering_mosaic.gpu.rules import TABLE
from lowering_mosaic.gpu.host import (TRITON_HINT, broadcast_in_dim,
                                      constant, ir_type, is_ref, is_vector, phys,
                                      phys_position, reshape, typed)
from lowering_mosaic.gpu.mesh_accumulators import fenced
from lowering_mosaic.gpu.rules.dot import smem_source
from lowering_mosaic.gpu.rules.elementwise import convert


@TABLE.register(lax.broadcast_in_dim_p)
def _broadcast_in_dim(ctx, x, *_dyn, shape, broadcast_dimensions, **_):
  return broadcast_in_dim(x, ctx.avals_in[0].shape, shape,
                          list(broadcast_dimensions), ctx.avals_in[0].dtype)


@TABLE.register(lax.reshape_p, lax.squeeze_p,
                getattr(lax, "expand_dims_p", None))
def _reshape_rule(ctx, x, *_dyn, **_):
  return reshape(x, ctx.avals_in[0].shape, ctx.out_aval.shape,
                 ctx.out_aval.dtype)


def _zeros(v) -> bool:
  """Whether `v` is a splat of 0.0 (a wgmma that accumulates into
  nothing: its result is the product alone)."""
  op = getattr(getattr(v, "owner", None), "opview", None)
  if op is not None and op.operation.name == "mosaic_gpu.optimization_barrier":
    return _zeros(op.operands[0])     # fenced for the wgmma (rules/dot.py)
  if op is None or op.operation.name != "vector.broadcast":
    return False
  src = getattr(getattr(op.operands[0], "owner", None), "opview", None)
  if src is None or src.operation.name != "arith.constant":
    return False
  value = src.attributes["value"]
  return isinstance(value, ir.FloatAttr) and value.value == 0.0


def _transposed_product(ctx, x):
  """`x` transposed, if it is a wgmma's result whose operands both sit in
  shared memory: (A B)^T = B^T A^T, one wgmma on transposed views; else
  None."""
  op = getattr(getattr(x, "owner", None), "opview", None)
  if op is None or op.operation.name != "mosaic_gpu.wgmma":
    return None
  acc, a, b = op.operands
  if not is_ref(a) or not _zeros(acc):
    return None
  m, n = ir.VectorType(x.type).shape
  if n % 64 or m > 256 or m % 8:
    return None
  zero = fenced(constant(0.0, (n, m), np.float32))
  out = mgpu.wgmma(zero, mgpu_utils.memref_transpose(b, (1, 0)),
                   mgpu_utils.memref_transpose(a, (1, 0)))
  nvvm.wgmma_commit_group_sync_aligned()
  nvvm.wgmma_wait_group_sync_aligned(0)
  return out


@TABLE.register(lax.transpose_p)
def _transpose(ctx, x, *, permutation):
  """A 2-D tile of 16-bit or 8-bit values is re-read through a transposed
  view of the shared memory it was read from (which a dot then takes as a
  transposed wgmma operand); a tile computed in registers is first staged
  in the buffer the plan set aside for this equation. The float32 result
  of a dot of operands in shared memory becomes the product of their
  transposes."""
  if len(phys(ctx.avals_in[0].shape)) < 2:
    return x                  # unit dims move: the same physical vector
  if tuple(permutation) != (1, 0):
    raise ctx.error("only 2-D tiles can be transposed by the Mosaic GPU "
                    "lowering" + TRITON_HINT)
  product = _transposed_product(ctx, x)
  if product is not None:
    return product
  if dtypes.bits(ctx.avals_in[0].dtype) > 16:
    raise ctx.error("only tiles of 16-bit or 8-bit values (and the results "
                    "of dots of operands in shared memory) can be "
                    "transposed by the Mosaic GPU lowering" + TRITON_HINT)
  src = smem_source(x)
  if src is None:
    (src,) = ctx.host.scoped[id(ctx.eqn)]
    mgpu.vector_store(x, src)
    mgpu_utils.commit_shared()   # visible to loads and to wgmma's reads
  return mgpu.vector_load(mgpu_utils.memref_transpose(src, (1, 0)))


@TABLE.register(lax.iota_p)
def _iota(ctx, *_dyn, dtype, shape, dimension, **_):
  out = typed(shape, np.int32)
  if shape[dimension] == 1:
    return constant(0, shape, dtype)
  v = mgpu.broadcasted_iota(out, phys_position(shape)[dimension])
  if np.dtype(dtype) != np.int32:
    v = convert(v, np.int32, dtype, tuple(shape))
  return v


_KINDS = {
    lax.reduce_sum_p: {"f": "ADD", "i": "ADD"},
    lax.reduce_max_p: {"f": "MAXIMUMF", "i": "MAXSI", "u": "MAXUI"},
    lax.reduce_min_p: {"f": "MINIMUMF", "i": "MINSI", "u": "MINUI"},
    lax.reduce_and_p: {"i": "AND", "u": "AND"},
    lax.reduce_or_p: {"i": "OR", "u": "OR"},
}


def _identity(prim, dtype):
  dtype = np.dtype(dtype)
  if prim is lax.reduce_sum_p or prim is lax.reduce_or_p:
    return 0
  if prim is lax.reduce_and_p:
    return 1 if dtypes.is_bool(dtype) else -1
  big = prim is lax.reduce_min_p
  if dtypes.is_float(dtype):
    return np.inf if big else -np.inf
  info = np.iinfo(dtype) if not dtypes.is_bool(dtype) else None
  if info is None:
    return 1 if big else 0
  return info.max if big else info.min


def _combining_kind(ctx, prim, dtype):
  kind_of = "f" if dtypes.is_float(dtype) else (
      "u" if dtypes.is_unsigned(dtype) or dtypes.is_bool(dtype) else "i")
  kind = _KINDS[prim].get(kind_of) or _KINDS[prim].get("i")
  if kind is None:
    raise ctx.error(f"'{prim.name}' is not supported on {dtype}")
  return getattr(vector.CombiningKind, kind)


def _reduce_rows(ctx, prim, x, shape, dtype):
  """A 2-D tile of 64-row multiples reduced over its last axis, in the
  wgmma row layout (the library reduces across the lanes that hold a row:
  no shared memory)."""
  kind = _combining_kind(ctx, prim, dtype)
  acc = constant(_identity(prim, dtype), shape[:1], dtype)
  x = mgpu.layout_cast(x, layouts.to_layout_attr(fa.WGMMA_LAYOUT))
  acc = mgpu.layout_cast(acc, layouts.to_layout_attr(fa.WGMMA_ROW_LAYOUT))
  return vector.multi_reduction(kind, x, acc, [1])


def _with_scratch(ctx, op):
  """Points a reduction at the plan's reduction scratch (shared memory the
  library uses when a reduction crosses the warps of the warpgroup)."""
  region = ctx.host.reduction_scratch
  if region is None:
    raise ctx.error("internal error: no reduction scratch was planned")
  offset, size = region
  i32 = ir.IntegerType.get_signless(32)
  op.attributes["offset"] = ir.IntegerAttr.get(i32, offset)
  op.attributes["scratch_size"] = ir.IntegerAttr.get(i32, size)
  return op.result


def _reduce_axis(ctx, prim, x, shape, axis, dtype):
  kind = _combining_kind(ctx, prim, dtype)
  out = shape[:axis] + shape[axis + 1:]
  acc = constant(_identity(prim, dtype), out, dtype)
  if len(shape) == 2 and shape[0] % 64 == 0:
    # Columns of a tile in the wgmma layout: rows are spread over warps.
    x = mgpu.layout_cast(x, layouts.to_layout_attr(fa.WGMMA_LAYOUT))
    acc = mgpu.layout_cast(acc, layouts.to_layout_attr(fa.WGMMA_COL_LAYOUT))
  op = vector.MultiDimReductionOp(kind, x, acc, [axis])
  return _with_scratch(ctx, op)


def _reduce_all(ctx, prim, x, shape, dtype):
  """To a scalar: `vector.reduction` takes 1-D vectors (flattened)."""
  kind = _combining_kind(ctx, prim, dtype)
  if len(shape) != 1:
    x = vector.shape_cast(typed((math.prod(shape),), dtype), x)
  op = vector.ReductionOp(ir_type(dtype), kind, x)
  return _with_scratch(ctx, op)


def physical_axes(shape, axes):
  """(physical shape, physical axes) of a reduction of a value of logical
  `shape` over `axes` (unit axes reduce to nothing)."""
  pos = phys_position(shape)
  return phys(shape), tuple(sorted(pos[a] for a in axes
                                   if pos[a] is not None))


def is_row_reduction(pshape, paxes) -> bool:
  """Reductions that stay inside warps (no scratch): the last axis of a
  2-D tile of 64-row multiples (physical shape and axes)."""
  return len(pshape) == 2 and paxes == (1,) and pshape[0] % 64 == 0


def crosses_warps(shape, axes) -> bool:
  """Whether reducing a value of logical `shape` over `axes` combines
  values of several warps (through shared scratch)."""
  pshape, paxes = physical_axes(shape, axes)
  return bool(paxes) and not is_row_reduction(pshape, paxes)


def _reduce_rule(prim):
  def rule(ctx, x, *, axes, **_):
    aval = ctx.avals_in[0]
    dtype = aval.dtype
    shape, axes = physical_axes(aval.shape, axes)
    if not is_vector(x) or not axes:
      return x
    if is_row_reduction(shape, axes):
      return _reduce_rows(ctx, prim, x, shape, dtype)
    if len(axes) == len(shape):
      return _reduce_all(ctx, prim, x, shape, dtype)
    if len(shape) == 2 and shape[0] % 64:
      raise ctx.error(f"reducing one axis of a 2-D tile needs rows in "
                      f"multiples of 64 (the warpgroup's wgmma register "
                      f"layout); this tile is {shape}: use blocks of 64-row "
                      "multiples" + TRITON_HINT)
    for a in reversed(axes):        # one axis at a time, the last first
      x = _reduce_axis(ctx, prim, x, shape, a, dtype)
      shape = shape[:a] + shape[a + 1:]
    return x
  return rule


REDUCTIONS = tuple(_KINDS)
for _p in _KINDS:
  TABLE.register(_p)(_reduce_rule(_p))
