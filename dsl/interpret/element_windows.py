"""The view of an input whose `Element` dims step with a grid axis: its
overlapping windows cut from shifted slices of the array (no gather).

An `Element` dim's windows overlap (a halo), so they are no reshape of the
array. Where the grid plan found its offsets to be `start + step * g` for
the coordinate g of one grid axis (`OperandPlan.windows`), window g is
`padded[start + step * g : start + step * g + block]`, `padded` the array
with the dim's padding and poison past its end, as the gather reads it.
Such a window is ceil(block / step) pieces, piece q the rows
`[q * step, (q + 1) * step)` of it; piece q of every window together is
one slice of the array (from `start + q * step`, `count * step` long)
reshaped to (count, step). Each piece is a slice of the unpadded array,
padded with poison where it reaches past it, so XLA fuses it into the
concatenation (no padded copy of the array is made first), and positions
outside the array read poison, as in every host backend.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from dsl.core.blockspec import BlockMapping, Element
from dsl.core.grid_plan import OperandPlan
from dsl.core.poison import poison_value


def _shifted(x, axis: int, first: int, length: int):
  """x[first : first + length] along `axis`; poison outside x."""
  n = x.shape[axis]
  lo, hi = min(max(first, 0), n), max(min(first + length, n), 0)
  if hi <= lo:    # wholly outside x
    shape = x.shape[:axis] + (length,) + x.shape[axis + 1:]
    return jnp.full(shape, poison_value(x.dtype), x.dtype)
  if (lo, hi) != (0, n):
    x = lax.slice_in_dim(x, lo, hi, axis=axis)
  config = [(0, 0, 0)] * x.ndim
  config[axis] = (lo - first, first + length - hi, 0)
  if config[axis] == (0, 0, 0):
    return x
  return lax.pad(x, jnp.asarray(poison_value(x.dtype), x.dtype), config)


def _windows(x, axis: int, first: int, step: int, count: int, size: int):
  """`axis` of `x` replaced by two, (count, size): window g is
  x[first + step * g : first + step * g + size], poison outside x."""
  if step == 0:
    return jnp.expand_dims(_shifted(x, axis, first, size), axis)
  parts = []
  for q in range(-(-size // step)):
    piece = _shifted(x, axis, first + q * step, count * step)
    piece = piece.reshape(x.shape[:axis] + (count, step) + x.shape[axis + 1:])
    rows = min(step, size - q * step)
    parts.append(lax.slice_in_dim(piece, 0, rows, axis=axis + 1)
                 if rows < step else piece)
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis + 1)


def _blocks(x, axis: int, block: int):
  """`axis` of `x` padded with poison to whole blocks and split in two,
  (blocks, block): `execute.pad` and `to_view` for one dim."""
  n = x.shape[axis]
  whole = -(-n // block) * block
  x = _shifted(x, axis, 0, whole)
  return x.reshape(x.shape[:axis] + (whole // block, block)
                   + x.shape[axis + 1:])


def input_view(x, op: OperandPlan, grid) -> jnp.ndarray:
  """The view (n0, b0, n1, b1, ...) of input `x` (not padded) whose plan
  has `windows`: blocked dims padded and split, `Element` dims cut into
  their windows (n: the grid size of the dim's source, or 1)."""
  bm: BlockMapping = op.mapping
  for j in reversed(range(x.ndim)):    # the dims before j keep their axis
    dim, block = bm.block_shape[j], bm.block_sizes[j]
    if op.windows[j] is None:
      x = _blocks(x, j, block)
      continue
    assert isinstance(dim, Element)
    start, step = op.windows[j]
    kind, d = op.sources[j]
    count = grid[d] if kind == "grid" else 1
    x = _windows(x, j, start - dim.padding[0], step, count, block)
  return x
