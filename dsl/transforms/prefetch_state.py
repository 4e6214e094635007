"""Scalar-prefetch refs a kernel writes, as state in reverse mode.

SMEM keeps what a grid point writes there for the next point, so such refs
are state the kernel carries from point to point, as it does in scratch
(`grid_plan.written_prefetch`). The transposed kernel visits the points in
another order, and what a point does (which buffer a DMA filled, whether it
starts one) may depend on that state: the recording kernel saves what each
point finds in them, in per-point SMEM blocks, and the transposed kernel
differentiates the point with those values. SMEM is read and written a
scalar at a time, so they are copied element by element.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from dsl.core.memory import MemorySpace
from dsl.core.pallas_call import KernelSpec
from dsl.transforms.common import written_prefetch
from dsl.transforms.revisits import per_point_sds, per_point_spec


def prefetch_states(spec: KernelSpec):
  """The avals of the scalar-prefetch refs `spec`'s kernel writes."""
  gm = spec.grid_mapping
  return [a.inner_aval for a, w in zip(gm.prefetch_avals,
                                       written_prefetch(spec)) if w]


def record_sds(aval, grid):
  """The array of what each grid point finds in a written prefetch ref."""
  return per_point_sds(aval.shape, aval.dtype, grid)


def record_spec(aval, n_grid, ids_fn=lambda ids: ids):
  return per_point_spec(aval.shape, n_grid, ids_fn,
                        memory_space=MemorySpace.SMEM)


def save(records, pf_refs, written) -> None:
  """Copies the written prefetch refs into their records."""
  for r, pf in zip(records, [p for p, w in zip(pf_refs, written) if w]):
    for idx in np.ndindex(pf.shape):
      r[idx] = pf[idx]


def value_of(record):
  """What a record holds, as a value."""
  shape = record.shape
  flat = [jnp.reshape(record[idx], (1,)) for idx in np.ndindex(shape)]
  flat = flat[0] if len(flat) == 1 else lax.concatenate(flat, 0)
  return flat.reshape(shape)
