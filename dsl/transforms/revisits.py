"""Revisited blocks in derived kernels, under a TPU's output semantics.

A TPU never reads an output block from HBM: when an output's block index
changes, the new block's buffer holds stale data, and a block that the grid
leaves and comes back to has lost what was written before. The kernels that
reverse mode derives follow that rule on every backend:

- an output block whose index maps revisit only over consecutive steps is
  initialized at the first step of each run of visits (`first_visit`:
  the block index differs from the previous step's);
- an input cotangent whose blocks are revisited non-consecutively (a
  matmul's dx over the j dim) is not accumulated in the kernel: each grid
  point writes its own contribution into a per-point array
  (`per_point_sds`, `per_point_spec`), and `scatter_contributions` adds
  them up outside the kernel.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from dsl.core.jax_internals import core

from dsl.core.blockspec import BlockSpec
from dsl.core.index_maps import block_offsets, evaluate_index_map
from dsl.core.output_revisits import first_revisit


def _pad(shape) -> int:
  """Unit dims between a per-point array's grid dims and its block's: a TPU
  block may squeeze its last two dims only where the array's are 1, so a
  block of rank < 2 gets unit dims there instead of grid dims."""
  return max(0, 2 - len(shape))


def per_point_sds(shape, dtype, grid) -> jax.ShapeDtypeStruct:
  """An array holding a block of `shape` for every grid point."""
  return jax.ShapeDtypeStruct(
      tuple(grid) + (1,) * _pad(shape) + tuple(shape), dtype)


def per_point_spec(shape, n_grid, ids_fn=lambda ids: ids,
                   memory_space=None, n_lead=None) -> BlockSpec:
  """Grid point `ids` owns the block at `ids_fn(ids)` of a per-point array
  (over a grid of rank `n_lead`, the kernel's own by default)."""
  pad = _pad(shape)
  n_lead = n_grid if n_lead is None else n_lead
  return BlockSpec((None,) * (n_lead + pad) + tuple(shape),
                   lambda *a: (*ids_fn(a[:n_grid]),) + (0,) * (pad + len(shape)),
                   memory_space=memory_space)


def _block_index(bm, ids, pf_refs):
  return core.jaxpr_as_fun(bm.index_map_jaxpr)(*ids, *pf_refs)


def every_step_new(bm, grid, ids_fn) -> bool:
  """Whether, visiting `grid` row-major, every step's block of `bm` (at
  `ids_fn(step)`) differs from the previous step's (known at trace time:
  the index map reads no scalar prefetch)."""
  if not all(isinstance(g, (int, np.integer)) for g in grid):
    return False       # a grid size traced
  if math.prod(grid) > 1 << 16:
    return False
  idx = evaluate_index_map(bm, tuple(grid))
  if idx is None:
    return False
  steps = [np.asarray(c).reshape(-1) for c in np.indices(grid)]
  at = [np.asarray(i).reshape(-1) for i in ids_fn(steps)]
  blocks = idx[tuple(at)].reshape(len(steps[0]), -1)
  return bool(np.all(np.any(blocks[1:] != blocks[:-1], axis=1)))


def first_visit(bm, grid, raw, ids_fn, pf_refs):
  """Whether the step at `raw` (the kernel's own ids, row-major) starts a
  run of visits to its block of `bm` (whose index map takes `ids_fn(raw)`):
  the first step, or one whose block differs from the previous step's.
  A Python True where every step starts one (decided at trace time)."""
  if not grid or every_step_new(bm, grid, ids_fn):
    return True
  prev, borrow = list(raw), jnp.bool_(True)
  for d in reversed(range(len(grid))):
    wrap = borrow & (raw[d] == 0)
    prev[d] = jnp.where(wrap, grid[d] - 1,
                        jnp.where(borrow, raw[d] - 1, raw[d]))
    borrow = wrap
  now = _block_index(bm, ids_fn(raw), pf_refs)
  before = _block_index(bm, ids_fn(prev), pf_refs)
  changed = jnp.bool_(False)
  for a, b in zip(now, before):
    changed = changed | (a != b)
  return borrow | changed       # `borrow` survives only at the first step


def revisits_consecutively(bm, grid, sequential) -> bool:
  """Whether, visiting the grid row-major with the `sequential` dims
  reversed, every block of `bm` is visited in one run of steps. False when
  the index map cannot be evaluated statically (it reads scalar prefetch)."""
  idx = evaluate_index_map(bm, tuple(grid))
  if idx is None:
    return False
  for d in sequential:
    idx = np.flip(idx, axis=d)
  return first_revisit(idx) is None


def scatter_contributions(contribs, bm, grid, prefetch):
  """The sum, into an array like `bm`'s, of the block each grid point wrote
  into the per-point array `contribs` (positions past the array dropped)."""
  sizes = bm.block_sizes
  n_points = math.prod(grid)
  coords = [jnp.asarray(c.reshape(-1), jnp.int32) for c in np.indices(grid)]

  def offsets(*ids):
    return jnp.stack(block_offsets(bm, ids, prefetch))

  starts = (jax.vmap(offsets)(*coords) if grid else offsets()[None])
  # Element offsets count from the padded array's start: the accumulator
  # has that padding in front and a block's room past the end.
  front = [d.padding[0] if hasattr(d, "padding") else 0
           for d in bm.block_shape]
  shape = [f + n + b for f, n, b in zip(front, bm.array_aval.shape, sizes)]
  acc = jnp.zeros(shape, contribs.dtype)
  updates = contribs.reshape((n_points,) + tuple(sizes))
  rank = len(sizes)
  dnums = lax.ScatterDimensionNumbers(
      update_window_dims=tuple(range(1, rank + 1)),
      inserted_window_dims=(), scatter_dims_to_operand_dims=tuple(range(rank)))
  acc = lax.scatter_add(acc, starts.astype(jnp.int32), updates, dnums,
                        indices_are_sorted=False, unique_indices=False)
  return acc[tuple(slice(f, f + n)
                   for f, n in zip(front, bm.array_aval.shape))]


def zero_unvisited(x, bm, grid):
  """`x`, an array like `bm`'s, with 0 where no grid point's block of `bm`
  reaches (a derived kernel's output there is memory it never wrote:
  poison, where a cotangent must be 0). Index maps that read scalar
  prefetch are not evaluated here (their cotangents are summed from
  per-point contributions instead)."""
  if bm.whole_array or not bm.block_shape:
    return x
  idx = evaluate_index_map(bm, tuple(grid))
  if idx is None:
    return x
  shape = tuple(bm.array_aval.shape)
  covered = np.zeros(shape, bool)
  for block in np.unique(idx.reshape(-1, idx.shape[-1]), axis=0):
    starts = bm.element_offsets([int(b) for b in block])
    covered[tuple(slice(max(int(s), 0), max(int(s) + b, 0))
                  for s, b in zip(starts, bm.block_sizes))] = True
  if covered.all():
    return x
  return jnp.where(covered, x, jnp.zeros((), x.dtype))
