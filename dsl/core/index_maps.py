"""What a grid's index maps say, evaluated at trace time.

Every grid point's block indices (`evaluate_index_map`, cached per mapping),
whether an index map reads scalar-prefetch data (then it has no static
answer), whether a block moves along a grid dim, and the check that every
static block starts inside its array. `GridMapping` answers these questions
for each of its operands (`gm.block_indices(bm)`, `gm.reads_prefetch(bm)`,
`gm.moves_along(bm, d)`); backends and transformations ask it, never the
index map jaxprs directly. At run time, `block_offsets` evaluates an index
map on traced grid ids and prefetch values (the host backends and derived
kernels).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from dsl.core.jax_internals import ClosedJaxpr, core

from dsl.core import bounded_discharge
from dsl.core.blockspec import BlockMapping, Element
from dsl.core.errors import KernelError

# Grids with more points are not analysed (their maps count as dynamic).
MAX_ANALYSED_POINTS = 1 << 22


def reads_prefetch(jaxpr: ClosedJaxpr, grid_rank: int) -> bool:
  """Whether an index map (its jaxpr: grid ids, then prefetch refs) reads
  scalar-prefetch data."""
  prefetch_vars = set(jaxpr.jaxpr.invars[grid_rank:])
  if not prefetch_vars:
    return False
  for eqn in jaxpr.jaxpr.eqns:
    if any(v in prefetch_vars for v in eqn.invars if isinstance(v, core.Var)):
      return True
  return any(v in prefetch_vars for v in jaxpr.jaxpr.outvars
             if isinstance(v, core.Var))


@functools.lru_cache(maxsize=512)
def evaluate_index_map(bm: BlockMapping, grid: tuple[int, ...]):
  """Block indices of every grid point: int array (*grid, rank), or None.

  The result is cached per mapping and read-only.
  """
  n_points = math.prod(grid)
  if n_points > MAX_ANALYSED_POINTS or reads_prefetch(bm.index_map_jaxpr,
                                                      len(grid)):
    return None
  rank = len(bm.block_shape)
  if rank == 0:
    return np.zeros((*grid, 0), np.int64)
  coords = [c.reshape(-1).astype(np.int32) for c in np.indices(grid)]
  jaxpr = bm.index_map_jaxpr
  n_prefetch = len(jaxpr.jaxpr.invars) - len(grid)

  def one_point(*ids):
    return core.jaxpr_as_fun(jaxpr)(*ids, *([None] * n_prefetch))

  with jax.ensure_compile_time_eval():
    if not grid:
      outs = one_point()
    else:
      outs = jax.vmap(one_point)(*coords)
    try:
      outs = [np.broadcast_to(np.asarray(o), (n_points,)) for o in outs]
    except jax.errors.TracerArrayConversionError:
      # Under some enclosing transforms (vmap of a shard_map) a computed
      # index stays a tracer: no static answer, as for prefetch maps.
      return None
  idx = np.stack(outs, axis=-1).reshape(*grid, rank).astype(np.int64)
  idx.flags.writeable = False
  return idx


def dim_limits(bm: BlockMapping):
  """Per array dim: (block size, one past the largest legal start index)."""
  limits = []
  for d, n, b in zip(bm.block_shape, bm.array_aval.shape, bm.block_sizes):
    if isinstance(d, Element):
      lo, hi = d.padding
      limits.append((1, n + lo + hi))      # an element offset
    else:
      limits.append((b, n))
  return limits


def check_block_indices(kernel: str, gm, where: str) -> None:
  """Raises KernelError when a static index map puts a block outside its array.

  A block may hang over the array's end (a partial edge block of a `cdiv`
  grid) but must start inside it.
  """
  for bm in gm.block_mappings:
    if bm.whole_array or not bm.block_shape:
      continue
    idx = gm.block_indices(bm)
    if idx is None or idx.size == 0:
      continue
    for j, (unit, end) in enumerate(dim_limits(bm)):
      if bm.array_aval.shape[j] == 0:
        continue
      col = idx[..., j]
      bad = np.argwhere((col < 0) | (col * unit >= end))
      if bad.size == 0:
        continue
      point = tuple(int(c) for c in bad[0])
      block = tuple(int(v) for v in idx[point])
      element = isinstance(bm.block_shape[j], Element)
      what = "element offset" if element else "block index"
      hint = ("an Element dim takes an element offset into the padded array"
              if element else "index maps return block indices, not element "
              "offsets")
      raise KernelError(
          kernel, f"at grid point {point} the index map returns {block}: "
          f"{what} {block[j]} of dim {j} lies outside the array "
          f"(shape {tuple(bm.array_aval.shape)}, block "
          f"{tuple(bm.block_sizes)}); {hint}", where, operand=bm.origin)


def varies_along(idx: np.ndarray, d: int, dim: int | None = None) -> bool:
  """Whether the block indices `idx` (of shape (*grid, rank)) change along
  grid dim `d`: in any array dim, or in array dim `dim` alone."""
  if dim is not None:
    idx = idx[..., dim:dim + 1]
  return idx.shape[d] > 1 and bool(np.any(np.diff(idx, axis=d) != 0))


def blocks_per_dim(bm: BlockMapping) -> tuple[int, ...]:
  """Blocks per array dim (a zero-size dim, whose block is empty: none)."""
  return tuple(-(-n // b) if b else 0
               for n, b in zip(bm.array_aval.shape, bm.block_sizes))


@functools.lru_cache(maxsize=1024)
def discharged_index_map(jaxpr: ClosedJaxpr, grid_rank: int):
  """The index map as a pure function of grid ids and prefetch values."""
  n = len(jaxpr.jaxpr.invars)
  if n == grid_rank:
    return jaxpr
  should = [False] * grid_rank + [True] * (n - grid_rank)
  return bounded_discharge.discharge(jaxpr, should)


def block_offsets(bm: BlockMapping, ids, prefetch):
  """The element offsets of the block of `bm` at grid ids `ids` (traced
  values), its index map reading the prefetch values `prefetch`."""
  dj = discharged_index_map(bm.index_map_jaxpr, len(ids))
  idx = core.eval_jaxpr(dj.jaxpr, dj.consts, *ids, *prefetch)
  idx = idx[:len(bm.block_shape)]
  return [jnp.asarray(o, jnp.int32) for o in bm.element_offsets(idx)]
