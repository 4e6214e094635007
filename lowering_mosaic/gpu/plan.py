"""What a kernel needs from the GPU before any code is emitted: the CUDA
grid, which operands stay in shared memory across sequential steps, the
shared-memory budget and the TMA alignment rules. Every failure here is a
BackendError at lowering time naming the operand."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from dsl.blockspec import BlockMapping, Element, squeezed
from dsl.errors import BackendError
from dsl.index_maps import varies_along
from dsl.jaxpr_walk import sub_jaxprs
from dsl.primitives import run_scoped_p
from lowering_mosaic.gpu.host import TRITON_HINT

WARPGROUP = 128                 # threads per CTA: one warpgroup
SMEM_LIMIT = 227 * 1024         # bytes of shared memory per CTA (sm_90)
MBARRIER_BYTES = 8
PIPELINE_DEPTH = 2              # slots of an input that moves along the loop
TMA_MAX_RANK = 5
TMA_MAX_BOX = 256               # elements per dim of one TMA copy
SMEM_ALIGN = 1024               # buffer alignment (128-byte swizzle atoms)


@dataclasses.dataclass(frozen=True)
class Block:
  """One input or output block: where it lives and when it moves."""
  mapping: BlockMapping
  is_output: bool
  kernel_shape: tuple[int, ...]     # the shared-memory buffer's shape
  slice_lengths: tuple[int, ...]    # TMA box per array dim (-1 = squeezed)
  moves: bool                       # its block changes along sequential dims
  slots: int = 1                    # buffers in shared memory (pipeline depth)
  in_gmem: bool = False             # the kernel reads/writes it in place

  def copies(self) -> list[tuple[int, int]]:
    """(start, length) along the buffer's first dim of each TMA copy: a
    block longer than a TMA box there moves in several copies, each a
    contiguous run of rows of the buffer."""
    n = self.kernel_shape[0] if self.kernel_shape else 1
    if n <= TMA_MAX_BOX or len(self.kernel_shape) < 2:
      return [(0, n)]
    return [(a, min(TMA_MAX_BOX, n - a)) for a in range(0, n, TMA_MAX_BOX)]

  @property
  def first_dim(self) -> int:
    """The array dim of the buffer's first dim."""
    return next(i for i, n in enumerate(self.slice_lengths) if n != -1)

  @property
  def nbytes(self) -> int:
    """Bytes of one block (what one TMA copy moves)."""
    return math.prod(self.kernel_shape) * self.mapping.array_aval.dtype.itemsize

  @property
  def buffer_shape(self) -> tuple[int, ...]:
    return ((self.slots,) if self.slots > 1 else ()) + self.kernel_shape


@dataclasses.dataclass(frozen=True)
class GpuPlan:
  grid: tuple[int, ...]
  parallel: tuple[int, ...]         # grid dims flattened into the CUDA grid
  sequential: tuple[int, ...]       # grid dims looped over inside one CTA
  blocks: tuple[Block, ...]         # inputs then outputs
  scratch: tuple[tuple[tuple[int, ...], np.dtype], ...]
  smem_bytes: int
  prefetch: tuple = ()              # avals of the scalar-prefetch operands
  # run_scoped buffers: (id of the equation, ((shape, dtype), ...)) each
  scoped: tuple = ()

  @property
  def cuda_grid(self) -> int:
    return math.prod(self.grid[d] for d in self.parallel)

  @property
  def steps(self) -> int:
    return math.prod(self.grid[d] for d in self.sequential)


def _err(spec, message, operand=None):
  return BackendError(spec.name, message + TRITON_HINT, spec.where,
                      operand=operand)


def _check_tma(spec, bm: BlockMapping, lengths):
  aval = bm.array_aval
  itemsize = aval.dtype.itemsize
  if len(aval.shape) > TMA_MAX_RANK:
    raise _err(spec, f"TMA copies arrays of rank at most {TMA_MAX_RANK}, "
               f"this one has rank {len(aval.shape)}", bm.origin)
  if not aval.shape:
    raise _err(spec, "0-d operands cannot be copied by TMA", bm.origin)
  stride = itemsize
  for n in reversed(aval.shape[1:]):
    stride *= n
    if stride % 16:
      raise _err(spec, f"TMA needs every array stride but the last to be a "
                 f"multiple of 16 bytes; array {aval.str_short()} has a "
                 f"stride of {stride} bytes (unaligned TMA box)", bm.origin)
  kept = [n for n in lengths if n != -1]
  too_long = [n for n in kept[1:] if n > TMA_MAX_BOX]
  if too_long or (len(kept) == 1 and kept[0] > TMA_MAX_BOX):
    raise _err(spec, f"a TMA copy spans at most {TMA_MAX_BOX} elements per "
               f"dimension, and only the first dim of a block of rank >= 2 is "
               f"split into several copies; the block "
               f"{tuple(bm.block_sizes)} is too long elsewhere (make that dim "
               f"at most {TMA_MAX_BOX} and cover the rest with the grid)",
               bm.origin)
  last = lengths[-1]
  if last == -1 or (last * itemsize) % 16:
    width = itemsize if last == -1 else last * itemsize
    raise _err(spec, f"the block's last dimension spans {width} bytes; TMA "
               "boxes must span a multiple of 16 bytes along the last "
               "dimension (unaligned TMA box)", bm.origin)


def _scratch_of(spec, aval, what):
  inner = getattr(aval, "inner_aval", aval)
  try:
    dtype = np.dtype(getattr(inner, "dtype", None))
  except TypeError:
    raise _err(spec, f"scratch of type {inner} (semaphores) is not "
               "supported by the Mosaic GPU lowering", what) from None
  return tuple(inner.shape), dtype


def scoped_allocations(spec, jaxpr) -> list:
  """(id(eqn), buffers) of every run_scoped equation in `jaxpr`, nested
  ones included: each gets its own shared-memory buffers."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive is run_scoped_p:
      body, n = eqn.params["jaxpr"], eqn.params["num_consts"]
      out.append((id(eqn), tuple(_scratch_of(spec, v.aval, "run_scoped")
                                 for v in body.invars[n:])))
    for sub in sub_jaxprs(eqn.params):
      out += scoped_allocations(spec, sub)
  return out


def _tma_can_copy(spec, bm) -> bool:
  lengths = tuple(int(n) for n in bm.block_sizes)
  try:
    _check_tma(spec, bm, lengths)
  except BackendError:
    return False
  return True


def _block(spec, bm, is_output, idx, sequential) -> Block:
  if bm.whole_array and (bm.memory_space is not None
                         or not _tma_can_copy(spec, bm)):
    # pl.ANY / SMEM-space arrays, and whole arrays TMA cannot copy (0-d,
    # unaligned): the kernel's ref is the array in global memory.
    return Block(bm, is_output, tuple(bm.array_aval.shape),
                 tuple(bm.array_aval.shape), False, in_gmem=True)
  if any(isinstance(d, Element) for d in bm.block_shape):
    raise _err(spec, "Element block dims (element offsets) are not "
               "supported by the Mosaic GPU lowering", bm.origin)
  lengths = tuple(-1 if d is squeezed else int(n)
                  for d, n in zip(bm.block_shape, bm.block_sizes))
  _check_tma(spec, bm, lengths)
  if idx is None:
    moves = bool(sequential)
  else:
    moves = any(varies_along(idx, d) for d in sequential)
  return Block(bm, is_output, tuple(bm.kernel_shape), lengths, moves)


def make_gpu_plan(spec) -> GpuPlan:
  gm = spec.grid_mapping
  plan = gm.plan(spec.compiler_params, spec.jaxpr)
  grid = tuple(int(g) for g in gm.grid)
  blocks = []
  for k, bm in enumerate(gm.block_mappings):
    idx = gm.block_indices(bm)
    blocks.append(_block(spec, bm, k >= gm.num_inputs, idx, plan.sequential))
  scratch = [_scratch_of(spec, ref, f"scratch_shapes[{i}]")
             for i, ref in enumerate(gm.scratch_avals)]
  scoped = tuple(scoped_allocations(spec, spec.jaxpr.jaxpr))
  if any(grid[d] > 1 for d in plan.sequential):
    blocks = [dataclasses.replace(b, slots=PIPELINE_DEPTH)
              if b.moves and not b.is_output and not b.in_gmem else b
              for b in blocks]
  sizes = [b.nbytes * b.slots for b in blocks if not b.in_gmem]
  sizes += [math.prod(s) * d.itemsize for s, d in scratch]
  sizes += [math.prod(s) * d.itemsize for _, bufs in scoped for s, d in bufs]
  smem = sum(-(-n // SMEM_ALIGN) * SMEM_ALIGN for n in sizes)
  smem += 3 * MBARRIER_BYTES
  if smem > SMEM_LIMIT:
    parts = ", ".join(f"{b.mapping.origin} {b.slots} x {b.nbytes}"
                      for b in blocks)
    raise _err(spec, f"the kernel needs {smem} bytes of shared memory "
               f"(blocks: {parts}; plus scratch and barriers), more than the "
               f"{SMEM_LIMIT} bytes a CTA can have; use smaller blocks")
  if math.prod(grid[d] for d in plan.parallel) >= 2 ** 31:
    raise _err(spec, "the parallel grid has more than 2**31 - 1 points")
  prefetch = tuple(getattr(r, "inner_aval", r) for r in gm.prefetch_avals)
  return GpuPlan(grid, tuple(plan.parallel), tuple(plan.sequential),
                 tuple(blocks), tuple(scratch), smem, prefetch, scoped)
