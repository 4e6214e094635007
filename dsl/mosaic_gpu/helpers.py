"""Loop and layout helpers of `plgpu`, built from lax operations: the
swizzle a shared-memory tile takes (`find_swizzle`), a loop over a grid of
work items shared out among the programs of grid axes (`nd_loop`, what a
persistent kernel iterates), and a locality-friendly order of the tiles of a
2D grid (`planar_snake`)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
from jax import lax


def find_swizzle(minor_dim_bits: int, what: str = "") -> int:
  """The largest swizzle (bytes: 128, 64, 32 or 16) that divides a minor
  dimension of `minor_dim_bits` bits."""
  for swizzle in (128, 64, 32, 16):
    if minor_dim_bits % (swizzle * 8) == 0:
      return swizzle
  what = f" for {what}" if what else ""
  raise ValueError(f"No valid out swizzle{what}: minor dimension has "
                   f"{minor_dim_bits} bits, which is not a multiple of 128 "
                   "(16 bytes)")


@dataclasses.dataclass(frozen=True, eq=False)
class NDLoopInfo:
  """One step of `nd_loop`: the work item's grid `index`, the step's number
  among this program's (`local_index`) and how many this program runs
  (`num_local_steps`)."""
  index: tuple[jax.Array, ...]
  local_index: Any
  num_local_steps: Any


def _axes(collective_axes) -> tuple[Hashable, ...]:
  if isinstance(collective_axes, (tuple, list)):
    return tuple(collective_axes)
  return (collective_axes,)


def _linear_axis_index(axes):
  """The program's index along `axes` (row-major) and their total size."""
  index, size = jnp.int32(0), 1
  for name in axes:
    n = lax.axis_size(name)
    index = index * n + lax.axis_index(name)
    size *= n
  return index, size


def unravel(step, dims) -> tuple:
  """Row-major coordinates of `step` (an int32 scalar) in a grid of
  `dims`."""
  step = jnp.asarray(step, jnp.int32)
  out = []
  for d in reversed(list(dims)):
    d = lax.convert_element_type(d, step.dtype)
    out.append(lax.rem(step, d))
    step = lax.div(step, d)
  return tuple(out[::-1])


def nd_loop(grid: Sequence[Any], *, collective_axes,
            tiling: Sequence[int] | None = None, init_carry=None
            ) -> Callable:
  """Decorator: runs `body(NDLoopInfo)` (or `body(info, carry=c)` -> new
  carry, with `init_carry`) for the items of `grid` this program owns: item
  `s` (row-major; with `tiling`, tile by tile) belongs to the program whose
  linear index along `collective_axes` is `s % size`."""
  axes = _axes(collective_axes)
  index, size = _linear_axis_index(axes)
  dims = list(grid)
  if tiling:
    if len(tiling) != len(dims):
      raise ValueError(f"tiling={tuple(tiling)} and grid={tuple(grid)} must "
                       "have the same length")
    for d, t in zip(dims, tiling):
      if isinstance(d, int) and d % t:
        raise ValueError(f"Tiling {tuple(tiling)} does not divide grid "
                         f"{tuple(grid)}")
    dims = [d // t for d, t in zip(dims, tiling)] + list(tiling)
  total = math.prod(dims) if all(isinstance(d, int) for d in dims) else (
      jnp.prod(jnp.asarray(dims, jnp.int32)))
  total = jnp.asarray(total, jnp.int32)
  steps = lax.div(total - index + (size - 1), jnp.int32(size))

  def decorate(body):
    def one(local, carry):
      coords = list(unravel(local * size + index, dims))
      if tiling:
        n = len(tiling)
        coords = [tile * t + sub for tile, sub, t in
                  zip(coords[:n], coords[n:], tiling)]
      info = NDLoopInfo(tuple(coords), local, steps)
      if init_carry is None:
        body(info)
        return carry
      return body(info, carry=carry)
    return lax.fori_loop(jnp.int32(0), steps, one, init_carry)
  return decorate


def planar_snake(lin_idx, shape, minor_dim: int, tile_width: int):
  """The (row, col) of the `lin_idx`-th tile of a 2D grid of `shape` in an
  order that keeps neighbours close: the minor dim (`minor_dim`) is cut into
  strips of `tile_width`, each strip is walked along the major dim, every
  other strip backwards."""
  lin_idx = jnp.asarray(lin_idx, jnp.int32)
  minor_size = jnp.int32(shape[minor_dim])
  major_size = jnp.int32(shape[1 - minor_dim])
  width = jnp.int32(tile_width)
  strip = lax.div(lin_idx, width * major_size)
  within = lax.rem(lin_idx, width * major_size)
  # the last strip may be narrower
  this_width = jnp.minimum(width, minor_size - strip * width)
  major = lax.div(within, this_width)
  major = jnp.where(lax.rem(strip, jnp.int32(2)) == 0, major,
                    major_size - 1 - major)
  minor = strip * width + lax.rem(within, this_width)
  return (minor, major) if minor_dim == 0 else (major, minor)
