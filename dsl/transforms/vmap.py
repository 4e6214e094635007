"""vmap: the batch becomes a new leading grid dimension.

Batched operands get a leading squeezed block dim indexed by that grid
dimension; unbatched operands keep their BlockSpecs. A batched rank-1
operand also gets a unit dim after the batch one, `(batch, 1, n)`, so its
squeezed batch dim is not the second-minor one (a TPU block may squeeze its
last two dims only where the array's are 1). The kernel body is
unchanged and its own `program_id(k)` numbering does not see the new dim.
The traced sizes of a grid's dynamic dims stay operands of the new kernel;
batched ones (a size per batch element) take the loop fallback.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from dsl.core.jax_internals import batching

from dsl.core.dynamic_grid import shift_axes
from dsl.core.memory import MemorySpace
from dsl.core.pallas_call import KernelSpec, pallas_call_p
from dsl.core.tracing import program_id
from dsl.transforms.common import block_spec_of, derived_spec, eval_ref_jaxpr, sds


def _batched_by_loop(args, dims, spec):
  """Fallback: one call per batch element (for batched scalar prefetch,
  grid sizes or unblocked `ANY` operands, whose refs cannot take a batch
  block dim)."""
  args = [batching.moveaxis(a, d, 0) if d is not None else a
          for a, d in zip(args, dims)]
  batched = [d is not None for d in dims]

  def one(xs):
    it = iter(xs)
    full = [next(it) if b else a for a, b in zip(args, batched)]
    return pallas_call_p.bind(*full, spec=spec)

  outs = lax.map(one, [a for a, b in zip(args, batched) if b])
  return outs, [0] * len(outs)


def pallas_call_batch(args, dims, *, spec: KernelSpec):
  gm = spec.grid_mapping
  n_grid = len(gm.grid)
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  in_dims = gm.split_operands(dims)
  unblocked = any(d is not None and bm.memory_space is MemorySpace.ANY
                  for d, bm in zip(in_dims.inputs, gm.in_mappings))
  if any(d is not None for d in in_dims.prefetch + in_dims.sizes) or (
      unblocked or any(bm.memory_space is MemorySpace.ANY
                       for bm in gm.out_mappings)):
    return _batched_by_loop(args, dims, spec)
  n_sizes = len(in_dims.sizes)
  operands = gm.split_operands(args)
  grid_sizes = list(operands.sizes)
  args = list(operands.prefetch + operands.inputs)
  dims = list(in_dims.prefetch + in_dims.inputs)
  args = [batching.moveaxis(a, d, 0) if d is not None else a
          for a, d in zip(args, dims)]
  batched = [d is not None for d in dims]
  # An unbatched input aliased to a (batched) output is broadcast first.
  for i, _ in spec.input_output_aliases:
    if not batched[i]:
      args[i] = jnp.broadcast_to(args[i], (size,) + args[i].shape)
      batched[i] = True

  jaxpr = shift_axes(spec.jaxpr, 1)

  def body(*refs):
    ids = [program_id(d + 1) for d in range(n_grid)]
    eval_ref_jaxpr(jaxpr, *ids, *refs)

  in_batched = gm.split_operands([False] * n_sizes + batched)
  inner = lambda ids: ids[1:]

  def batch_spec(bm):
    unit = _unit(bm)
    return block_spec_of(bm, n_grid + 1, inner,
                         lambda ids: (ids[0],) + (0,) * unit, 1 + unit)

  def batch_sds(bm):
    return sds(bm.array_aval, (size,) + (1,) * _unit(bm))

  in_specs = [batch_spec(bm) if b else block_spec_of(bm, n_grid + 1, inner)
              for bm, b in zip(gm.in_mappings, in_batched.inputs)]
  out_specs = [batch_spec(bm) for bm in gm.out_mappings]
  arg_shapes = ([sds(a.inner_aval, (size,) if b else ()) for a, b in
                 zip(gm.prefetch_avals, in_batched.prefetch)]
                + [batch_sds(bm) if b else sds(bm.array_aval)
                   for bm, b in zip(gm.in_mappings, in_batched.inputs)])
  out_shapes = [batch_sds(bm) for bm in gm.out_mappings]
  operand_layout = gm.call_layout().only("prefetch", "inputs")
  pf_args, in_args = operand_layout.split(args)
  args = list(pf_args) + [
      a.reshape(s.shape) if b else a
      for a, s, b in zip(in_args, operand_layout.split(arg_shapes).inputs,
                         in_batched.inputs)]
  new = derived_spec(spec, body, arg_shapes, out_shapes,
                     grid=(size,) + tuple(gm.grid), in_specs=in_specs,
                     out_specs=out_specs, scratch=list(gm.scratch_avals),
                     aliases=dict(spec.input_output_aliases), suffix="")
  # the same refs in the same order: they keep the user's names
  new = new.replace(grid_mapping=dataclasses.replace(
      new.grid_mapping, num_hidden_axes=gm.num_hidden_axes + 1),
      ref_names=spec.ref_names)
  outs = pallas_call_p.bind(*grid_sizes, *args, spec=new)
  outs = [o.reshape((size,) + tuple(bm.array_aval.shape))
          for o, bm in zip(outs, gm.out_mappings)]
  return outs, [0] * len(outs)


def _unit(bm) -> int:
  """1 where a batched operand of `bm` gets a unit dim after the batch dim."""
  return 1 if len(bm.array_aval.shape) == 1 else 0


batching.primitive_batchers[pallas_call_p] = pallas_call_batch
