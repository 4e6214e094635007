"""`emit_pipeline`: a grid of blocks run inside a kernel.

The body is called once per point of `grid` (in row-major order) with views
of the operand refs: the block each BlockSpec's index map picks there. The
views are windows of the operands themselves, not copies: the host backends
read and write the operands in place, which gives the results Pallas's
double-buffered pipeline gives. Buffering hints (`tiling`, core axes,
`dimension_semantics`, allocations) are accepted and not used.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from dsl.blockspec import BlockSpec, Blocked, Element, squeezed
from dsl.errors import KernelError, user_frame
from dsl.refs import ds


def _specs(specs) -> tuple:
  if isinstance(specs, BlockSpec) or specs is None:
    return (specs,)
  return tuple(specs)


def _block_view(ref, spec: BlockSpec | None, indices):
  """The window of `ref` that `spec` picks at grid point `indices`."""
  if spec is None or spec.block_shape is None:
    return ref
  block_idx = spec.index_map(*indices) if spec.index_map else (
      (0,) * len(spec.block_shape))
  if not isinstance(block_idx, (tuple, list)):
    block_idx = (block_idx,)
  if len(block_idx) != len(spec.block_shape):
    raise KernelError(None, f"emit_pipeline: index_map returns "
                      f"{len(block_idx)} indices for block "
                      f"{tuple(spec.block_shape)}", spec.where or user_frame())
  window = []
  for d, i in zip(spec.block_shape, block_idx):
    if d is None or d is squeezed:
      window.append(i)
    elif isinstance(d, Element):
      window.append(ds(i, d.block_size))
    else:
      size = d.block_size if isinstance(d, Blocked) else d
      window.append(ds(i * size, size))
  return ref.at[tuple(window)]


def _unravel(n, grid):
  """Grid indices of the row-major step `n`."""
  out = []
  for g in reversed(grid):
    out.append(n % g)
    n = n // g
  return tuple(reversed(out))


def emit_pipeline(body, *, grid, in_specs=(), out_specs=(), tiling=None,
                  core_axis=None, core_axis_name=None,
                  dimension_semantics=None, trace_scopes: bool = True,
                  no_pipelining: bool = False):
  """Returns `pipeline(*in_refs, *out_refs)`, which runs
  `body(*in_block_refs, *out_block_refs)` at every point of `grid`."""
  del tiling, core_axis, core_axis_name, dimension_semantics, trace_scopes
  del no_pipelining
  grid = tuple(grid)
  if any(isinstance(g, int) and g <= 0 for g in grid):
    raise ValueError(f"All elements in the grid must be strictly positive, "
                     f"but got grid={grid}")
  in_specs, out_specs = _specs(in_specs), _specs(out_specs)
  specs = in_specs + out_specs

  def pipeline(*refs, allocations=None, scratches=None, first_cycle=None,
               last_cycle=None, init_accumulators=None, prefetch=None,
               postyeet=None, schedule=None, body_prologue=None):
    del allocations, scratches, first_cycle, last_cycle, init_accumulators
    del prefetch, postyeet, schedule, body_prologue
    if len(refs) != len(specs):
      raise KernelError(None, f"emit_pipeline has {len(in_specs)} in_specs "
                        f"and {len(out_specs)} out_specs but was called with "
                        f"{len(refs)} refs", user_frame())

    def step(n, carry):
      indices = _unravel(n, grid)
      body(*[_block_view(r, s, indices) for r, s in zip(refs, specs)])
      return carry

    total = math.prod(grid) if grid else 1
    lax.fori_loop(0, total, step, jnp.int32(0))

  return pipeline
