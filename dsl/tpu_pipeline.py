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
  buffered as in Pallas (see dsl/tpu_pipeline_dma.py). A TPU kernel cannot
  read HBM directly, and the host backends then run the very schedule the
  TPU runs (an output block starts uninitialized, as on a TPU).
- a view: everything else (operands already in VMEM or SMEM, and every
  operand on Triton and Mosaic GPU, whose refs are global memory) is a window
  of the operand itself: reads and writes go to the operand in place.

Which backend the kernel is traced for is set by `pallas_call` around the
trace (`dsl.backends.tracing_for`); the automatic backend counts as the default of the
platform JAX runs on. Tiling, core axes, `dimension_semantics` and the
allocation/schedule arguments are accepted and not used.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax._src import core

from dsl.backends import traced_backend
from dsl.blockspec import BlockSpec, Blocked, Element, squeezed
from dsl.errors import KernelError, user_frame
from dsl.memory import MemorySpace
from dsl.refs import ds

def backend_copies_blocks() -> bool:
  """Whether the kernel being traced must copy HBM blocks into VMEM."""
  return traced_backend().copies_hbm_blocks


def ref_memory_space(ref):
  """The memory space of a kernel ref or of a view of one (`x.at[...]`)."""
  base = getattr(ref, "ref", ref)
  aval = base.aval if hasattr(base, "aval") else core.get_aval(base)
  return getattr(aval, "memory_space", None)


def in_hbm(ref) -> bool:
  return ref_memory_space(ref) in (MemorySpace.ANY, MemorySpace.HBM)


def _specs(specs) -> tuple:
  if isinstance(specs, BlockSpec) or specs is None:
    return (specs,)
  return tuple(specs)


def kernel_name() -> str | None:
  from dsl.tracing import _GRID_ENV
  env = _GRID_ENV.get()
  return env.kernel if env is not None else None


def block_indices(spec: BlockSpec, label: str, indices) -> tuple:
  """What `spec`'s index map returns at grid point `indices`, as a tuple."""
  block_idx = spec.index_map(*indices) if spec.index_map else (
      (0,) * len(spec.block_shape))
  if not isinstance(block_idx, (tuple, list)):
    block_idx = (block_idx,)
  if len(block_idx) != len(spec.block_shape):
    raise KernelError(kernel_name(), f"emit_pipeline: the index map returns "
                      f"{len(block_idx)} indices for block "
                      f"{tuple(spec.block_shape)}",
                      spec.where or user_frame(), operand=label)
  return tuple(block_idx)


def block_window(spec: BlockSpec, block_idx) -> tuple:
  """The indexer of the block at block indices `block_idx`."""
  window = []
  for d, i in zip(spec.block_shape, block_idx):
    if d is None or d is squeezed:
      window.append(i)
    elif isinstance(d, Element):
      window.append(ds(i, d.block_size))
    else:
      size = d.block_size if isinstance(d, Blocked) else d
      window.append(ds(i * size, size))
  return tuple(window)


def _block_view(ref, spec: BlockSpec | None, label: str, indices):
  """The window of `ref` that `spec` picks at grid point `indices`."""
  if spec is None or spec.block_shape is None:
    return ref
  return ref.at[block_window(spec, block_indices(spec, label, indices))]


def unravel(n, grid):
  """Grid indices of the row-major step `n`."""
  out = []
  for g in reversed(grid):
    out.append(n % g)
    n = n // g
  return tuple(reversed(out))


def run_body(body, grid, indices, refs, scratches, prologue=None):
  """`prologue()` then `body(*refs, *scratches)`, with `pl.program_id`
  giving `indices`."""
  from dsl.tracing import grid_axis_names, grid_env
  # The outer grid's axis names stay bound (lax.axis_index of them).
  with grid_env(kernel_name() or "kernel", indices, grid, grid_axis_names()):
    if prologue is not None:
      prologue()
    body(*refs, *scratches)


def _run_views(body, grid, refs, specs, labels, scratches, prologue):
  def step(n, carry):
    indices = unravel(n, grid)
    views = [_block_view(r, s, l, indices)
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
      from dsl.tpu_pipeline_dma import run_copied
      run_copied(body, grid, refs, specs, labels, copied, len(in_specs),
                 scratches, buffered=not no_pipelining,
                 trace_scopes=trace_scopes, prologue=body_prologue)
    else:
      _run_views(body, grid, refs, specs, labels, scratches, body_prologue)

  return pipeline
