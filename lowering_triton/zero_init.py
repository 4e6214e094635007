"""Which outputs a GPU launch must zero-fill first.

The interpret backend's outputs start as zeros, and kernels that accumulate
into `o_ref` rely on it. An output needs no zeroing when the kernel's first
access to it is an unconditional store of the whole block and the grid visits
every block (or when it is aliased to an input, whose data it starts from).
"""
from __future__ import annotations

import math

import numpy as np
from jax import tree_util
from jax._src.state import indexing
from jax._src.state import primitives as state_primitives

from dsl.core.index_maps import blocks_per_dim


def _full_indexer(eqn) -> bool:
  tree = eqn.params.get("tree")
  try:
    transforms = tree_util.tree_unflatten(tree, list(eqn.invars[2:]))
  except Exception:
    return False
  if len(transforms) != 1 or not isinstance(transforms[0], indexing.NDIndexer):
    return len(transforms) == 0
  ix = transforms[0]
  for idx, n in zip(ix.indices, ix.shape):
    if not isinstance(idx, indexing.Slice):
      return False
    if not (isinstance(idx.start, int) and idx.start == 0 and
            int(idx.size) == n and int(idx.stride) == 1):
      return False
  return True


def zero_outputs(spec) -> tuple[bool, ...]:
  """Outputs that must be zeroed before a GPU launch: those the kernel may
  read before writing, or not write at all (the interpret backend's outputs
  start as zeros)."""
  gm = spec.grid_mapping
  j = spec.jaxpr.jaxpr
  out_vars = gm.split(j.invars).outputs
  aliased = {o for _, o in spec.input_output_aliases}
  result = []
  for k, (v, bm) in enumerate(zip(out_vars, gm.out_mappings)):
    if k in aliased:
      result.append(False)
      continue
    covered = False
    for eqn in j.eqns:
      if v in eqn.invars:
        covered = (eqn.primitive is state_primitives.swap_p and
                   eqn.invars[0] is v and _full_indexer(eqn))
        break
    if covered and not bm.whole_array:
      idx = gm.block_indices(bm)
      if idx is None:
        covered = False
      else:
        n_blocks = math.prod(blocks_per_dim(bm))
        rank = idx.shape[-1]
        visited = (len(np.unique(idx.reshape(-1, rank), axis=0)) if rank
                   else 1)
        covered = visited >= n_blocks
    result.append(not covered)
  return tuple(result)
