"""Shape primitives -> `vector` / `tpu` ops; `dot_general` -> `tpu.matmul`."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from dsl.core.jax_internals import ir, lax_internal, tpu, vector

from lowering_mosaic.tpu import emit
from lowering_mosaic.tpu.host import ZeroSize, has_zero_size
from lowering_mosaic.tpu.rules import register


@register(lax.broadcast_in_dim_p)
def _broadcast_in_dim(ctx, x, *dyn, shape, broadcast_dimensions, sharding=None):
  aval = ctx.avals_in[0]
  shape = tuple(shape)
  if aval.shape == shape:
    return x
  if aval.shape == ():
    return emit.broadcast_to(x, shape, aval.dtype)
  interm = [1] * len(shape)
  for src_dim, out_dim in enumerate(broadcast_dimensions):
    interm[out_dim] = aval.shape[src_dim]
  x = emit.reshape(x, aval.shape, tuple(interm), aval.dtype)
  if tuple(interm) == shape:
    return x
  return vector.BroadcastOp(emit.vtype(shape, aval.dtype), x).result


@register(lax.reshape_p)
def _reshape(ctx, x, *dyn, new_sizes, dimensions=None, sharding=None):
  if dimensions is not None and tuple(dimensions) != tuple(
      range(len(ctx.avals_in[0].shape))):
    raise ctx.error("with a dimension permutation is not supported")
  aval = ctx.avals_in[0]
  return emit.reshape(x, aval.shape, tuple(new_sizes), aval.dtype)


@register(lax.squeeze_p)
def _squeeze(ctx, x, *, dimensions):
  aval, out = ctx.avals_in[0], ctx.out_aval
  return emit.reshape(x, aval.shape, out.shape, aval.dtype)


@register(lax.transpose_p)
def _transpose(ctx, x, *, permutation):
  out = ctx.out_aval
  if tuple(permutation) == tuple(range(len(permutation))):
    return x
  return tpu.TransposeOp(emit.vtype(out.shape, out.dtype), x,
                         list(permutation)).result


@register(lax.iota_p)
def _iota(ctx, *dyn, dtype, shape, dimension, sharding=None):
  shape = tuple(shape)
  if shape == ():
    return emit.zeros((), dtype)
  if len(shape) == 1:     # Mosaic's iota is 2-D at least (as Pallas)
    v = tpu.IotaOp(emit.vtype((1,) + shape, jnp.int32), [1]).result
    v = emit.reshape(v, (1,) + shape, shape, jnp.int32)
  else:
    v = tpu.IotaOp(emit.vtype(shape, jnp.int32), [dimension]).result
  return emit.convert(v, shape, jnp.int32, dtype)


@register(lax.concatenate_p)
def _concatenate(ctx, *xs, dimension):
  xs = [x for x, a in zip(xs, ctx.avals_in) if not has_zero_size(a)]
  if not xs:
    return ZeroSize(ctx.out_aval)
  if len(xs) == 1:
    return xs[0]
  return tpu.ConcatenateOp(xs, dimension).result


@register(lax.tile_p)
def _tile(ctx, x, *, reps):
  """`jnp.tile`: per axis with reps > 1, one `tpu.concatenate` of that many
  copies (as Pallas)."""
  for axis, n in enumerate(reps):
    if n > 1:
      x = tpu.ConcatenateOp([x] * n, axis).result
  return x


def _extract(x, out, offsets, sizes):
  """`vector.extract_strided_slice` (unit strides), or a ZeroSize value."""
  if has_zero_size(out):
    return ZeroSize(out)
  return vector.ExtractStridedSliceOp(
      emit.vtype(out.shape, out.dtype), x, list(offsets), list(sizes),
      [1] * len(sizes)).result


@register(lax.slice_p)
def _slice(ctx, x, *, start_indices, limit_indices, strides):
  aval, out = ctx.avals_in[0], ctx.out_aval
  strides = list(strides) if strides is not None else [1] * len(aval.shape)
  if any(s != 1 for s in strides):
    raise ctx.error("with strides is not supported by the Mosaic lowering")
  if out.shape == aval.shape:
    return x
  return _extract(x, out, start_indices, out.shape)


@register(lax.split_p)
def _split(ctx, x, *, sizes, axis):
  aval = ctx.avals_in[0]
  outs, start = [], 0
  for size, out in zip(sizes, ctx.avals_out):
    offsets = [0] * len(aval.shape)
    offsets[axis] = start
    outs.append(_extract(x, out, offsets, out.shape))
    start += size
  return outs


@register(lax_internal.unstack_p)
def _unstack(ctx, x, *, axis):
  """One unit slice per index along `axis`, its dim dropped (as Pallas)."""
  aval, out = ctx.avals_in[0], ctx.out_aval
  unit = list(aval.shape)
  unit[axis] = 1
  sliced = aval.update(shape=tuple(unit))
  outs = []
  for i in range(aval.shape[axis]):
    offsets = [0] * len(aval.shape)
    offsets[axis] = i
    piece = _extract(x, sliced, offsets, unit)
    outs.append(emit.reshape(piece, unit, out.shape, aval.dtype))
  return outs


def dot_dimension_numbers(lhs_contract, rhs_contract, lhs_batch, rhs_batch,
                          lhs_rank, rhs_rank) -> ir.Attribute:
  """`#tpu.dot_dimension_numbers<lhs_c, rhs_c, lhs_nc, rhs_nc, out_order,
  lhs_b, rhs_b>`; out_order lists (operand, dim) pairs: batch dims, then
  lhs then rhs non-contracting dims (dot_general's output order)."""
  lhs_nc = [d for d in range(lhs_rank)
            if d not in lhs_contract and d not in lhs_batch]
  rhs_nc = [d for d in range(rhs_rank)
            if d not in rhs_contract and d not in rhs_batch]
  order = []
  for d in lhs_batch:
    order += [0, d]
  for d in lhs_nc:
    order += [0, d]
  for d in rhs_nc:
    order += [1, d]

  def lst(xs):
    return "[" + ", ".join(str(int(v)) for v in xs) + "]"
  return ir.Attribute.parse(
      f"#tpu.dot_dimension_numbers<{lst(lhs_contract)}, {lst(rhs_contract)}, "
      f"{lst(lhs_nc)}, {lst(rhs_nc)}, {lst(order)}, {lst(lhs_batch)}, "
      f"{lst(rhs_batch)}>")


@register(lax.dot_general_p)
def _dot_general(ctx, lhs, rhs, *, dimension_numbers, precision=None,
                 preferred_element_type=None, out_sharding=None, **params):
  (lc, rc), (lb, rb) = dimension_numbers
  la, ra = ctx.avals_in
  out = ctx.out_aval
  if len(lc) != 1 or len(la.shape) < 2 or len(ra.shape) < 2:
    raise ctx.error("needs 2D (or batched 2D) operands with one contracting "
                    f"dim, got {la.str_short()} x {ra.str_short()}")
  # operands of two dtypes (f32 x bf16) go to `tpu.matmul` as they are (as
  # Pallas): the MXU takes them mixed
  # The MXU accumulates in 32 bits: a narrower result (a bf16 or int8 dot
  # without preferred_element_type) is accumulated there and rounded once,
  # as XLA computes it.
  acc_dtype = out.dtype
  if jnp.dtype(out.dtype).itemsize < 4:
    acc_dtype = (jnp.float32 if jnp.issubdtype(out.dtype, jnp.floating)
                 else jnp.int32)
  acc = emit.zeros(out.shape, acc_dtype)
  dn = dot_dimension_numbers(list(lc), list(rc), list(lb), list(rb),
                             len(la.shape), len(ra.shape))
  result = tpu.MatmulOp(emit.vtype(out.shape, acc_dtype), lhs, rhs, acc, False,
                        dimension_numbers=dn).result
  return emit.convert(result, out.shape, acc_dtype, out.dtype)
