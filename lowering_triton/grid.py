"""The kernel grid on Triton's program ids.

Grid dims that revisit output blocks (a reduction axis in the grid, an
accumulator over steps) must run in order; they become `for` loops inside
each program, so an output block and the scratch buffers stay with one
program. The other (parallel) dims become program ids: up to three map to
`tl.program_id(0..2)` directly, the last parallel dim on axis 0; more, or
sizes beyond CUDA's limits on the y and z axes, are flattened onto
`tl.program_id(0)` in row-major order. Which dims are parallel is the grid's
execution plan (`GridMapping.plan`), as on every backend, and the dims it
runs in order only because every step stores to the same output, where dsl
proves the steps store apart and read none of it
(`dsl.core.disjoint_writes`): the kernel stores straight into the output
arrays, so their steps may run as separate programs.

Either way the programs start in the grid's row-major order (the last dim
fastest, as the interpret backend walks it): the GPU schedules axis 0
fastest, so programs that run at the same time differ in the inner grid dims
and share the blocks that index maps keep fixed along them (the keys and
values of one head in attention, a row of tiles in a matmul) in L2.
"""
from __future__ import annotations

import dataclasses
import math

from dsl.core.disjoint_writes import disjoint_write_dims

MAX_GRID_X = 2 ** 31 - 1
MAX_GRID_YZ = 65535


@dataclasses.dataclass(frozen=True)
class GridPlan:
  grid: tuple[int, ...]
  parallel: tuple[int, ...]
  sequential: tuple[int, ...]
  flattened: bool
  launch: tuple[int, int, int]

  @property
  def axes(self) -> tuple[int, ...]:
    """The parallel dims in program-id order: the last one on axis 0."""
    return self.parallel[::-1]

  def program_axis(self, dim: int) -> int | None:
    if self.flattened or dim not in self.parallel:
      return None
    return self.axes.index(dim)


def plan_grid(spec) -> GridPlan:
  grid_mapping = spec.grid_mapping
  grid = tuple(int(g) for g in grid_mapping.grid)
  plan = grid_mapping.plan(spec.compiler_params, spec.jaxpr)
  apart = disjoint_write_dims(spec)
  parallel = tuple(d for d in sorted(set(plan.parallel) | set(apart))
                   if grid[d] > 1)
  sequential = tuple(d for d in range(len(grid))
                     if d not in parallel and grid[d] > 1)
  sizes = [grid[d] for d in parallel[::-1]]     # x, y, z
  flattened = (len(sizes) > 3 or (sizes and sizes[0] > MAX_GRID_X)
               or any(s > MAX_GRID_YZ for s in sizes[1:]))
  if flattened:
    total = math.prod(sizes)
    if total > MAX_GRID_X:
      raise ValueError(f"grid {grid} has {total} parallel programs, more than "
                       f"CUDA's limit of {MAX_GRID_X}")
    launch = (total, 1, 1)
  else:
    launch = tuple(sizes) + (1,) * (3 - len(sizes))
  return GridPlan(grid, parallel, sequential, flattened, launch)
