"""The TensorCores of a simulated chip: which grid points each core runs,
and the output blocks two cores would both write back.

A chip of `InterpreterOptions.num_cores` cores (a megacore chip: 2) splits
the grid's leading "parallel" (and "core_parallel") dims between its cores,
as Mosaic does on such a chip: the points of those dims, in row-major order,
are cut into `num_cores` consecutive shares of ceil(points / num_cores)
(the last ones may be smaller or empty), and each core runs its share with
every point of the remaining dims, in row-major order, on its own SMEM,
VMEM, scratch and semaphores. A chip of one core runs the whole grid. The
cores run at the same time (the scheduler interleaves them), so two cores
that write back the same output block race: the later write-back wins on a
TPU, whichever it is.
"""
from __future__ import annotations

import math
import re

import numpy as np
from dsl.core.jax_internals import ir

from lowering_mosaic.verification.interpreter.simulator import (
    KernelRaceError, World)

# The semantics that let a dim's steps run on different cores.
SPLIT = ("parallel", "core_parallel")


def semantics_of(attrs) -> tuple:
  """The entry function's `dimension_semantics`, one name per grid dim."""
  if "dimension_semantics" not in attrs:
    return ()
  names = []
  for a in ir.ArrayAttr(attrs["dimension_semantics"]):
    m = re.search(r"<(\w+)>", str(a))
    names.append(m.group(1) if m else "arbitrary")
  return tuple(names)


def split_dims(semantics) -> int:
  """How many leading grid dims the cores split (parallel or
  core_parallel)."""
  n = 0
  while n < len(semantics) and semantics[n] in SPLIT:
    n += 1
  return n


def core_points(grid, semantics, num_cores: int, core: int):
  """The grid points `core` of a chip of `num_cores` runs, in order."""
  if num_cores == 1:
    yield from np.ndindex(*grid)
    return
  k = split_dims(semantics)
  outer, inner = tuple(grid[:k]), tuple(grid[k:])
  total = math.prod(outer)
  share = -(-total // num_cores)
  for flat in range(core * share, min((core + 1) * share, total)):
    head = tuple(int(i) for i in np.unravel_index(flat, outer)) if k else ()
    for tail in np.ndindex(*inner):
      yield head + tuple(tail)


def claim_output_block(world: World, dev: int, claims: dict, name: str,
                       idx, point, line) -> None:
  """Core `dev` starts output block `idx` at grid `point`; `claims` (one
  dict per output and chip) keeps the first core and point of each block.
  A block another core of the chip claimed is a race between the cores."""
  core = world.devices[dev].core
  first = claims.setdefault(tuple(idx), (core, tuple(point)))
  if first[0] == core:
    return
  other, at = first
  point = tuple(int(i) for i in point)
  world.report(KernelRaceError(
      "race", f"{world._prefix(dev)}: {name}: output block "
      f"{tuple(int(i) for i in idx)} is written back by core {core} (grid "
      f"point {point}) and by core {other} (grid point {at}); the cores of "
      f"a chip run at the same time, so one write-back overwrites the "
      f"other's. Fix: give each core its own output blocks (an index map "
      f"that depends on the leading parallel grid dims), or mark the dims "
      f"the output ignores \"arbitrary\"", (line,) if line else ()))
