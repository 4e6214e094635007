"""`emit_pipeline`: a grid of blocks run inside a kernel.

`emit_pipeline(body, grid=..., in_specs=..., out_specs=...)(*refs)` calls
`body` once per point of `grid` (in row-major order) on the block of each
operand that its BlockSpec's index map picks there. Inside `body`,
`pl.program_id` and `pl.num_programs` speak of the pipeline's grid, as in
Pallas. An operand reaches `body` in one of two ways:

- copied: an operand in HBM (`pl.ANY`, `tpu.HBM`) on a backend with DMA
  engines (Mosaic for TPU, its CPU interpreter, and the interpret backend,
  which discharges DMAs) streams through VMEM buffers: each block is copied
  in with `make_async_copy` before the body and out after it, double
  buffered as in Pallas (see dsl/tpu/pipeline_dma.py). A TPU kernel cannot
  read HBM directly, and the host backends then run the very schedule the
  TPU runs (an output block starts uninitialized, as on a TPU).
- a view: everything else (operands already in VMEM or SMEM, and every
  operand on Triton and Mosaic GPU, whose refs are global memory) is a window
  of the operand itself: reads and writes go to the operand in place.

Which backend the kernel is traced for is set by `pallas_call` around the
trace (`dsl.core.backends.tracing_for`); the automatic backend counts as the default of the
platform JAX runs on. Tiling, core axes, `dimension_semantics` and the
allocation/schedule arguments are accepted and not used.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from dsl.core.blockspec import BlockSpec
from dsl.core.errors import KernelError, user_frame
from dsl.tpu.pipeline_blocks import (backend_copies_blocks, block_view, in_hbm,
                                     run_body, unravel)
from dsl.tpu.pipeline_dma import run_copied


def _specs(specs) -> tuple:
  if isinstance(specs, BlockSpec) or specs is None:
    return (specs,)
  return tuple(specs)


def _run_views(body, grid, refs, specs, labels, scratches, prologue):
  def step(n, carry):
    indices = unravel(n, grid)
    views = [block_view(r, s, l, indices)
             for r, s, l in zip(refs, specs, labels)]
    run_body(body, grid, indices, views, scratches, prologue)
    return carry

  total = math.prod(grid) if grid else 1
  lax.fori_loop(0, total, step, jnp.int32(0))


def emit_pipeline(body, *, grid, in_specs=(), out_specs=(), tiling=None,
                  core_axis=None, core_axis_name=None,
                  dimension_semantics=None, trace_scopes: bool = True,
                  no_pipelining: bool = False):
  """Returns `pipeline(*in_refs, *out_refs)`, which runs
  `body(*in_block_refs, *out_block_refs)` at every point of `grid`;
  `no_pipelining=True` copies blocks synchronously (one buffer each)."""
  del tiling, core_axis, core_axis_name, dimension_semantics
  grid = tuple(grid)
  if any(isinstance(g, int) and g <= 0 for g in grid):
    raise ValueError(f"All elements in the grid must be strictly positive, "
                     f"but got grid={grid}")
  in_specs, out_specs = _specs(in_specs), _specs(out_specs)
  specs = in_specs + out_specs
  labels = ([f"emit_pipeline in_specs[{i}]" for i in range(len(in_specs))]
            + [f"emit_pipeline out_specs[{i}]"
               for i in range(len(out_specs))])

  def pipeline(*refs, allocations=None, scratches=None, first_cycle=None,
               last_cycle=None, init_accumulators=None, prefetch=None,
               postyeet=None, schedule=None, body_prologue=None):
    del allocations, first_cycle, last_cycle, init_accumulators
    del prefetch, postyeet, schedule
    if len(refs) != len(specs):
      raise KernelError(None, f"emit_pipeline has {len(in_specs)} in_specs "
                        f"and {len(out_specs)} out_specs but was called with "
                        f"{len(refs)} refs", user_frame())
    scratches = tuple(scratches or ())
    copied = [backend_copies_blocks() and in_hbm(r)
              and s is not None and s.block_shape is not None
              for r, s in zip(refs, specs)]
    if any(copied):
      run_copied(body, grid, refs, specs, labels, copied, len(in_specs),
                 scratches, buffered=not no_pipelining,
                 trace_scopes=trace_scopes, prologue=body_prologue)
    else:
      _run_views(body, grid, refs, specs, labels, scratches, body_prologue)

  return pipeline
