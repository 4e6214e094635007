"""A kernel as a function of values: its refs discharged into plain JAX
operations (the interpret backend's per-grid-point function, and the
function the derived kernels of jvp and transpose are built from)."""
from __future__ import annotations

import functools

from dsl.core.jax_internals import close_jaxpr, ClosedJaxpr

from dsl.core import bounded_discharge, config
from dsl.tpu.prng_state import with_prng_state


def discharged_kernel(jaxpr: ClosedJaxpr, grid_rank: int,
                      kept_refs: tuple[bool, ...] = ()):
  """The kernel as a function of values; the refs after the grid ids that
  `kept_refs` marks (a prefix: some scalar-prefetch refs) stay refs.
  Cached; what run_scoped allocations start as (jax_pallas_poison_buffers)
  is part of the key."""
  return _discharged_kernel(jaxpr, grid_rank, tuple(kept_refs),
                            config.poison_buffers())


@functools.lru_cache(maxsize=256)
def _discharged_kernel(jaxpr: ClosedJaxpr, grid_rank: int,
                       kept_refs: tuple[bool, ...], poison_buffers: bool):
  del poison_buffers     # read by run_scoped's discharge rule
  jaxpr = with_prng_state(jaxpr)      # the random state, if it draws
  j = jaxpr.jaxpr
  rest = len(j.invars) - grid_rank - len(kept_refs)
  should = ([False] * grid_rank + [not k for k in kept_refs]
            + [True] * rest)
  closed = close_jaxpr(j, jaxpr.consts)
  return bounded_discharge.discharge(closed, should)
