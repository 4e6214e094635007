"""Output blocks that a TPU's grid pipeline would revisit non-consecutively.

Mosaic's pipeline never reads an output block from HBM: when an output's
block index changes, the block it leaves is written back and the new one
starts with whatever the VMEM buffer held. A kernel may therefore accumulate
into an output block only over consecutive grid steps. When the block index
comes back to a block already written back, the earlier writes are lost.

With index maps evaluated at trace time (`GridMapping.block_indices`; maps that read
scalar prefetch are left to the run-time check of `mosaic_interpret`), this
walks the grid in row-major order and finds the first such return. The usual
cause is an index map that ignores a grid dim of size > 1 outer to one it
depends on (column sums over grid (rows, cols) with a block per col); the
error names those two dims.
"""
from __future__ import annotations

import numpy as np

from dsl.core.errors import KernelError
from dsl.core.index_maps import varies_along

FIX = ("make the grid dims this output's index map ignores the innermost, "
       "or accumulate in scratch")


def first_revisit(idx: np.ndarray):
  """For block indices `idx` of shape (*grid, rank): None, or (block, grid
  point of the return, first and last grid point of the earlier visit)."""
  grid = idx.shape[:-1]
  n = int(np.prod(grid)) if grid else 1
  if n < 3:
    return None
  flat = idx.reshape(n, -1)
  if flat.shape[1] == 0:
    return None
  change = np.any(flat[1:] != flat[:-1], axis=1)
  starts = np.concatenate([[0], np.nonzero(change)[0] + 1])
  runs = flat[starts]
  _, first, inverse = np.unique(runs, axis=0, return_index=True,
                                return_inverse=True)
  inverse = inverse.reshape(-1)
  again = np.nonzero(first[inverse] < np.arange(len(runs)))[0]
  if again.size == 0:
    return None
  r = int(again[0])
  earlier = int(first[inverse[r]])
  point = lambda f: tuple(int(i) for i in np.unravel_index(int(f), grid))
  return (tuple(int(v) for v in runs[r]), point(starts[r]),
          point(starts[earlier]), point(starts[earlier + 1] - 1))


def _dims(idx: np.ndarray):
  """(ignored dim d1, depended-on dim d2) with d1 outer to d2, both of size
  > 1, or None."""
  grid = idx.shape[:-1]
  depends = [d for d in range(len(grid)) if varies_along(idx, d)]
  for d1 in range(len(grid)):
    if grid[d1] > 1 and d1 not in depends:
      inner = [d for d in depends if d > d1]
      if inner:
        return d1, inner[0]
  return None


def check_output_revisits(kernel: str, gm, where, skip=()) -> None:
  """Raises KernelError for the first output whose block a TPU would revisit
  after writing it back. `skip`: output block mappings the pipeline does
  not window (`ANY`); a grid with a dynamic dim has no static answer."""
  if not gm.grid or gm.dynamic_dims:
    return
  grid = tuple(int(g) for g in gm.grid)
  hidden = gm.num_hidden_axes
  for bm in gm.out_mappings:
    if bm.whole_array or not bm.block_shape or any(bm is s for s in skip):
      continue
    idx = gm.block_indices(bm)
    if idx is None or idx.size == 0:
      continue
    found = first_revisit(idx)
    if found is None:
      continue
    block, again, first, last = found
    span = (f"grid point {first}" if first == last
            else f"grid points {first} to {last}")
    why = ""
    dims = _dims(idx)
    if dims is not None:
      d1, d2 = dims
      why = (f"its index map ignores grid dim {d1 - hidden} (size "
             f"{grid[d1]}) but depends on grid dim {d2 - hidden} (size "
             f"{grid[d2]}) inside it, so ")
    raise KernelError(
        kernel, f"{why}output block {block} is visited at {span}, written "
        f"back, and visited again at grid point {again}; a TPU never reads "
        "an output block back from HBM, so the earlier writes would be "
        f"lost. Fix: {FIX}", where, operand=bm.origin)
