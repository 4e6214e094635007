"""What `emit_pipeline` does at one grid point, on every backend: the block
a BlockSpec's index map picks there (`block_indices`, `block_window`,
`block_view`), and the body run with `pl.program_id` giving the point
(`run_body`); and whether the kernel being traced copies HBM blocks into
VMEM (`backend_copies_blocks`, from the backend's registry record)."""
from __future__ import annotations

from dsl.core.jax_internals import core

from dsl.core.backends import traced_backend
from dsl.core.blockspec import BlockSpec, Blocked, Element, squeezed
from dsl.core.errors import KernelError, user_frame
from dsl.core.memory import MemorySpace
from dsl.core.refs import ds
from dsl.core.tracing import grid_axis_names, grid_env, traced_kernel_name


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


def kernel_name() -> str | None:
  """The name of the kernel being traced, or None."""
  return traced_kernel_name()


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


def block_view(ref, spec: BlockSpec | None, label: str, indices):
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
  # The outer grid's axis names stay bound (lax.axis_index of them).
  with grid_env(kernel_name() or "kernel", indices, grid, grid_axis_names()):
    if prologue is not None:
      prologue()
    body(*refs, *scratches)
