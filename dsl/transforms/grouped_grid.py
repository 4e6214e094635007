"""A grid with one dim split into groups and the groups folded into another
dim: how a derived kernel visits the points that share a block.

Grouped-query attention reads kv block `(b, h // g, j)` at grid point
`(b, h, i, j)`: the `g` heads of a group share it, and so do all the q
blocks `i`. A kernel that sums a kv block's contributions over a grid dim
it stays put along must visit all its sharers along that one dim: the
grid `(b, h // g, g * nq, j)`, whose third dim `t` walks the group's heads
and, for each, the q blocks (`h = (h // g) * g + t // nq`, `i = t % nq`),
as a hand-written dK/dV kernel walks them. Under multi-query attention
(one kv head) the whole heads dim is folded: the kv block stays put along
one dim of `h * nq` steps, not along two (a scratch accumulator reset at
the first step of two dims would make the grid plan run every dim in
order).
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class GroupedGrid:
  grid: tuple[int, ...]     # the original grid
  split: int                # the dim split into groups of `size`
  size: int
  into: int                 # the dim the groups are folded into

  @property
  def new_grid(self) -> tuple[int, ...]:
    g = list(self.grid)
    g[self.split] //= self.size
    g[self.into] *= self.size
    return tuple(g)

  def original_ids(self, ids):
    """The original grid's ids of the new grid's point `ids`."""
    out = list(ids)
    n = self.grid[self.into]
    out[self.split] = ids[self.split] * self.size + ids[self.into] // n
    out[self.into] = ids[self.into] % n
    return out


def _grouped_by(idx, e, size) -> bool:
  """Whether block indices `idx` (*grid, rank) are the same for the ids of
  dim `e` within each group of `size` consecutive ones."""
  n = idx.shape[e]
  first = np.take(idx, [x - x % size for x in range(n)], axis=e)
  return bool(np.all(idx == first))


def grouping(grid, block_indices, const_dims, avoid) -> GroupedGrid | None:
  """A grouped grid under which each input's blocks differ at every point
  but along the dims they stay put along, or None: `block_indices` and
  `const_dims` per input; `avoid`, a dim that may not take part (the
  reduction's)."""
  for idx, const in zip(block_indices, const_dims):
    into = [f for f in const if f != avoid]
    for e in range(len(grid)):
      if e == avoid or e in const or not into:
        continue
      for size in range(grid[e], 1, -1):     # the largest groups
        if grid[e] % size == 0 and _grouped_by(idx, e, size):
          return GroupedGrid(tuple(grid), e, size, into[-1])
  return None


def folding(grid, const_dims, avoid) -> GroupedGrid | None:
  """A grid on which no input's blocks stay put along more than one dim
  (but `avoid`), folding the outer of two such dims into the inner, or
  None when none does."""
  for const in const_dims:
    dims = [e for e in const if e != avoid and grid[e] > 1]
    if len(dims) > 1:
      return GroupedGrid(tuple(grid), dims[0], grid[dims[0]], dims[-1])
  return None
