"""Broadcasts, reshapes, iota and reductions."""
from __future__ import annotations

import numpy as np
from jax import lax
from jax._src.lib.mlir.dialects import vector
from jax._src.lib import mosaic_gpu_dialect as mgpu
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.mosaic.gpu import layouts
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from dsl import dtypes
from lowering_mosaic.gpu.host import (TABLE, TRITON_HINT, broadcast_in_dim,
                                      constant, is_vector, reshape,
                                      scalar_constant, typed)


@TABLE.register(lax.broadcast_in_dim_p)
def _broadcast_in_dim(ctx, x, *_dyn, shape, broadcast_dimensions, **_):
  return broadcast_in_dim(x, shape, list(broadcast_dimensions),
                          ctx.avals_in[0].dtype)


@TABLE.register(lax.reshape_p)
def _reshape_rule(ctx, x, *_dyn, new_sizes, **_):
  return reshape(x, tuple(new_sizes), ctx.avals_out[0].dtype)


@TABLE.register(lax.squeeze_p)
def _squeeze(ctx, x, *, dimensions):
  return reshape(x, tuple(ctx.avals_out[0].shape), ctx.avals_out[0].dtype)


@TABLE.register(getattr(lax, "expand_dims_p", None))
def _expand_dims(ctx, x, **_):
  return reshape(x, tuple(ctx.avals_out[0].shape), ctx.avals_out[0].dtype)


@TABLE.register(lax.transpose_p)
def _transpose(ctx, x, *, permutation):
  """Only a 2-D tile read straight from shared memory transposes: it is
  re-read through a transposed view of the buffer (which a dot then takes
  as a transposed wgmma operand)."""
  from lowering_mosaic.gpu.rules.dot import smem_source
  src = smem_source(x)
  if (tuple(permutation) != (1, 0) or src is None
      or dtypes.bits(ctx.avals_in[0].dtype) > 16):
    raise ctx.error("only 2-D tiles of 16-bit or 8-bit values read straight "
                    "from a ref (dot operands) can be transposed by the "
                    "Mosaic GPU lowering" + TRITON_HINT)
  return mgpu.vector_load(mgpu_utils.memref_transpose(src, (1, 0)))


@TABLE.register(lax.iota_p)
def _iota(ctx, *_dyn, dtype, shape, dimension, **_):
  out = typed(shape, np.int32)
  if len(shape) == 0:
    return scalar_constant(0, dtype)
  v = mgpu.broadcasted_iota(out, dimension)
  if np.dtype(dtype) != np.int32:
    from lowering_mosaic.gpu.rules.elementwise import convert
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
  """A 2-D tile reduced over its last axis, in the wgmma row layout (the
  library reduces across the lanes that hold a row)."""
  kind = _combining_kind(ctx, prim, dtype)
  acc = constant(_identity(prim, dtype), shape[:1], dtype)
  x = mgpu.layout_cast(x, layouts.to_layout_attr(fa.WGMMA_LAYOUT))
  acc = mgpu.layout_cast(acc, layouts.to_layout_attr(fa.WGMMA_ROW_LAYOUT))
  return vector.multi_reduction(kind, x, acc, [1])


def _reduce_rule(prim):
  def rule(ctx, x, *, axes, **_):
    aval = ctx.avals_in[0]
    shape, dtype = tuple(aval.shape), aval.dtype
    axes = tuple(sorted(axes))
    if not is_vector(x):
      return x
    if len(shape) != 2 or axes != (1,):
      raise ctx.error(f"only reductions of a 2-D tile over its last axis are "
                      f"supported by Mosaic GPU's register layouts (this one "
                      f"reduces a {len(shape)}-D value over axes {axes}); "
                      "reduce rows, then combine the row results in a later "
                      "step, or transpose the block with its BlockSpec"
                      + TRITON_HINT)
    return _reduce_rows(ctx, prim, x, shape, dtype)
  return rule


for _p in _KINDS:
  TABLE.register(_p)(_reduce_rule(_p))

