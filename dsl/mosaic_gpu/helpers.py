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
  index along `collective_axes` is `s % size`; programs below
  `total % size` run one item more."""
  index = lax.axis_index(collective_axes)
  size = lax.axis_size(collective_axes)
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
  total = 1
  for d in dims:
    total = total * d
  total = jnp.astype(total, index.dtype)
  steps = lax.div(total, jnp.astype(size, index.dtype)) + (
      lax.convert_element_type(index < total % size, index.dtype))

  def decorate(body):
    def one(local, carry):
      coords = list(unravel(local * size + index, dims))
      if tiling:
        n = len(tiling)
        coords = [sub + tile * t for tile, sub, t in
                  zip(coords[:n], coords[n:], tiling)]
      info = NDLoopInfo(tuple(coords), local, steps)
      if init_carry is None:
        body(info)
        return carry
      return body(info, carry=carry)
    return lax.fori_loop(0, steps, one, init_carry)
  return decorate


def _divmod(a, b):
  return lax.div(a, b), lax.rem(a, b)


def planar_snake(lin_idx, shape, minor_dim: int, tile_width: int):
  """The (row, col) of the `lin_idx`-th tile of a 2D grid of `shape` in an
  order that keeps neighbours close: the minor dim (`minor_dim`) is cut into
  strips of `tile_width`, each strip is walked along the major dim, every
  other strip backwards; the last strip may be narrower. A power-of-two
  width branches between full and last strips; another computes both and
  selects (or branches, when the major size is a power of two)."""
  major_dim = 1 - minor_dim
  width_pow2 = tile_width & (tile_width - 1) == 0
  major_pow2 = isinstance(shape[major_dim], int) and (
      shape[major_dim] & (shape[major_dim] - 1) == 0)
  width = jnp.int32(tile_width)
  major_size = jnp.int32(shape[major_dim])
  minor_size = jnp.int32(shape[minor_dim])
  strip_size = width * major_size
  full_strips, last_width = _divmod(minor_size, width)
  in_full = lin_idx < full_strips * strip_size
  if width_pow2:
    strip, within = _divmod(lin_idx, strip_size)
    major, minor = lax.cond(in_full, lambda: _divmod(within, width),
                            lambda: _divmod(within, last_width))
  else:
    def full():
      line, minor = _divmod(lin_idx, width)
      return (*_divmod(line, major_size), minor)

    def last():
      return (full_strips,
              *_divmod(lin_idx - full_strips * strip_size, last_width))
    if major_pow2:
      strip, major, minor = lax.cond(in_full, full, last)
    else:
      strip, major, minor = (lax.select(in_full, f, l)
                             for f, l in zip(full(), last()))
  forwards = lax.rem(strip, jnp.int32(2)) == 0
  major = lax.select(forwards, major, major_size - 1 - major)
  minor = strip * width + minor
  return (minor, major) if minor_dim == 0 else (major, minor)
