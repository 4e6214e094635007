"""A KernelSpec as a Mosaic GPU module (warpgroup semantics).

One CTA of one warpgroup (128 threads) runs one point of the parallel grid
dims (flattened into the CUDA grid's x axis) and loops over the sequential
dims:

  - input blocks that stay put along the sequential dims are copied GMEM ->
    SMEM with TMA once, before the loop (`arrive_expect_tx` with their
    bytes on an mbarrier, then `wait`);
  - input blocks that move are double-buffered: step s runs on slot s % 2
    while TMA fills the other slot with step s + 1's blocks (one mbarrier
    per slot; block indices come from the index maps, lowered as scalar
    code);
  - the kernel body runs on the SMEM blocks (vector code; layout inference
    spreads each vector over the warpgroup's registers);
  - output blocks go SMEM -> GMEM with TMA: after every step for blocks that
    move along the sequential dims, once after the loop for blocks revisited
    along them (those stay on chip: the accumulator pattern).

The module is the library's: `core._lower_as_gpu_kernel` builds the launch,
`core.lower_mgpu_module` runs layout inference and lowers the dialect.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from jax._src.lib import mosaic_gpu_dialect as mgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, gpu, nvvm, scf
from jax.experimental.mosaic import gpu as mgpu_lib
from jax.experimental.mosaic.gpu import core as mgpu_core
from jax.experimental.mosaic.gpu import utils as mgpu_utils
import jax

from dsl.errors import BackendError
from dsl.jaxpr_walk import walk_jaxpr
from lowering_mosaic.gpu.host import (TRITON_HINT, GpuHost, i32,
                                      index_cast_i32)
from lowering_mosaic.gpu.plan import (MBARRIER_BYTES, SMEM_ALIGN, WARPGROUP,
                                      GpuPlan, make_gpu_plan)


@dataclasses.dataclass
class GpuModule:
  """A built kernel: the module handed to the custom call (layouts
  inferred, dialect lowered), the dialect-level text before inference (the
  readable one), and the plan."""
  module: ir.Module
  dialect_text: str
  plan: GpuPlan
  out_shapes: tuple


def _decode(flat: ir.Value, sizes: list[int]) -> list[ir.Value]:
  """Row-major coordinates of `flat` (i32) in a grid of `sizes`."""
  coords = []
  for n in reversed(sizes):
    coords.append(arith.remui(flat, i32(n)) if n > 1 else i32(0))
    flat = arith.divui(flat, i32(n)) if n > 1 else flat
  return coords[::-1]


def _copies(block, buf, offsets):
  """(SMEM view, GMEM offsets, box) of each TMA copy of `block`."""
  copies = block.copies()
  if len(copies) == 1:
    return [(buf, offsets, list(block.slice_lengths))]
  d = block.first_dim
  out = []
  for start, n in copies:
    offs = list(offsets)
    offs[d] = arith.addi(offs[d], i32(start))
    lengths = list(block.slice_lengths)
    lengths[d] = n
    out.append((mgpu_utils.memref_slice(buf, slice(start, start + n)), offs,
                lengths))
  return out


class _Emitter:
  def __init__(self, spec, plan: GpuPlan, host: GpuHost, where):
    self.spec, self.plan, self.host = spec, plan, host
    self.where = where     # positions of the buffers in the SMEM tree
    self.prefetch = []     # the scalar-prefetch operands, read in GMEM

  def block_offsets(self, block, ids) -> list[ir.Value]:
    """Element offsets (i32) of `block` at grid point `ids`."""
    bm = block.mapping
    closed = bm.index_map_jaxpr
    n_pf = len(closed.jaxpr.invars) - len(ids)
    idx = walk_jaxpr(self.host, closed.jaxpr, closed.consts,
                     list(ids) + list(self.prefetch)[:n_pf])
    offs = []
    for i, n in zip(idx, bm.block_sizes):
      i = index_cast_i32(i)
      offs.append(arith.muli(i, i32(int(n))) if n != 1 else i)
    return offs

  def issue(self, blocks, gmem, dests, barrier, ids, predicate=None):
    """Starts the TMA copies of `blocks` into `dests` on `barrier`; with a
    `predicate` (i1) they happen only where it holds (the barrier still
    completes a phase, with no bytes, where it does not)."""
    nbytes = sum(b.nbytes for b in blocks)
    tx = i32(nbytes)
    if predicate is not None:
      tx = arith.select(predicate, tx, i32(0))
    barrier.arrive_expect_tx(tx)
    for b in blocks:
      offsets = self.block_offsets(b, ids)
      for dest, offs, lengths in _copies(b, dests[b], offsets):
        mgpu.async_load(source=gmem[b], destination=dest,
                        barrier=barrier.as_barrier_memref(), indices=offs,
                        slice_lengths=lengths,
                        collective=ir.ArrayAttr.get([]), predicate=predicate)

  def load(self, blocks, gmem, smem, barrier, ids):
    if blocks:
      self.issue(blocks, gmem, smem, barrier, ids)
      barrier.wait()

  def store(self, blocks, gmem, smem, ids):
    if not blocks:
      return
    mgpu_utils.commit_shared()
    for b in blocks:
      for src, offs, lengths in _copies(b, smem[b],
                                        self.block_offsets(b, ids)):
        mgpu.async_store(source=src, destination=gmem[b], indices=offs,
                         slice_lengths=lengths)
    nvvm.cp_async_bulk_wait_group(0)
    mgpu_utils.warpgroup_barrier()

  def body(self, ids, refs):
    j = self.spec.jaxpr
    walk_jaxpr(self.host, j.jaxpr, j.consts, list(ids) + list(refs))

  def __call__(self, launch_ctx, *args):
    *gmem_refs, smem_tree = args
    plan = self.plan
    n_pf = len(plan.prefetch)
    self.prefetch, gmem_refs = list(gmem_refs[:n_pf]), gmem_refs[n_pf:]
    on_chip = [b for b in plan.blocks if not b.in_gmem]
    buffers = [smem_tree[i] for i in self.where]
    smem = dict(zip(on_chip, buffers[:len(on_chip)]))
    scratch = buffers[len(on_chip):len(on_chip) + len(plan.scratch)]
    rest = buffers[len(on_chip) + len(plan.scratch):]
    for key, bufs in plan.scoped:
      self.host.scoped[key], rest = rest[:len(bufs)], rest[len(bufs):]
    barriers = smem_tree[-1]
    gmem = dict(zip(plan.blocks, gmem_refs))
    ins = [b for b in on_chip if not b.is_output]
    outs = [b for b in on_chip if b.is_output]
    grid = plan.grid
    flat = index_cast_i32(gpu.block_id(gpu.Dimension.x))
    par = _decode(flat, [grid[d] for d in plan.parallel])

    def ids_at(seq_coords):
      ids = [None] * len(grid)
      for d, v in zip(plan.parallel, par):
        ids[d] = v
      for d, v in zip(plan.sequential, seq_coords):
        ids[d] = v
      return ids

    def refs(views):
      return (self.prefetch
              + [views.get(b, smem.get(b, gmem[b])) for b in plan.blocks]
              + scratch)

    if not any(b.slots > 1 for b in ins):
      self._unpipelined(ins, outs, gmem, smem, barriers[0], ids_at, refs)
    else:
      self._pipelined(ins, outs, gmem, smem, barriers, ids_at, refs)

  def _unpipelined(self, ins, outs, gmem, smem, barrier, ids_at, refs):
    """No input block moves along the sequential dims: load once, run
    every step on the same blocks; outputs that move are stored every step,
    the others once."""
    plan = self.plan
    seq_sizes = [plan.grid[d] for d in plan.sequential]
    first = ids_at([i32(0)] * len(seq_sizes))
    self.load(ins, gmem, smem, barrier, first)
    if plan.steps > 1:
      loop = scf.ForOp(*(arith.constant(ir.IndexType.get(), v)
                         for v in (0, plan.steps, 1)))
      with ir.InsertionPoint(loop.body):
        step = index_cast_i32(loop.induction_variable)
        ids = ids_at(_decode(step, seq_sizes))
        self.body(ids, refs({}))
        self.store([b for b in outs if b.moves], gmem, smem, ids)
        scf.yield_([])
      last = ids_at([i32(n - 1) for n in seq_sizes])
      outs = [b for b in outs if not b.moves]
    else:
      self.body(first, refs({}))
      last = first
    self.store(outs, gmem, smem, last)

  def _pipelined(self, ins, outs, gmem, smem, barriers, ids_at, refs):
    """Inputs that move along the sequential dims rotate through
    PIPELINE_DEPTH slots: step s computes on slot s % 2 while TMA fills
    the other slot with step s + 1's blocks (barrier per slot)."""
    plan = self.plan
    steps = plan.steps
    seq_sizes = [plan.grid[d] for d in plan.sequential]
    fixed = [b for b in ins if b.slots == 1]
    piped = [b for b in ins if b.slots > 1]
    first = ids_at([i32(0)] * len(seq_sizes))
    self.load(fixed, gmem, smem, barriers[2], first)
    idx = ir.IndexType.get()

    def views(slot):
      return {b: mgpu_utils.memref_slice(smem[b], slot) for b in piped}

    self.issue(piped, gmem, views(arith.constant(idx, 0)), barriers[0], first)
    loop = scf.ForOp(*(arith.constant(idx, v) for v in (0, steps, 1)))
    with ir.InsertionPoint(loop.body):
      s = index_cast_i32(loop.induction_variable)
      slot = arith.remui(s, i32(2))
      other = arith.subi(i32(1), slot)
      nxt = arith.addi(s, i32(1))
      more = arith.cmpi(arith.CmpIPredicate.ult, nxt, i32(steps))
      nxt = arith.minui(nxt, i32(steps - 1))
      self.issue(piped, gmem, views(arith.index_cast(idx, other)),
                 barriers[other], ids_at(_decode(nxt, seq_sizes)), more)
      barriers[slot].wait()
      ids = ids_at(_decode(s, seq_sizes))
      self.body(ids, refs(views(arith.index_cast(idx, slot))))
      mgpu_utils.warpgroup_barrier()   # the slot is refilled next step
      self.store([b for b in outs if b.moves], gmem, smem, ids)
      scf.yield_([])
    barriers[steps % 2].wait()         # the last, empty, prefetch
    last = ids_at([i32(n - 1) for n in seq_sizes])
    self.store([b for b in outs if not b.moves], gmem, smem, last)


def _aligned(buffers):
  """`buffers` with uint8 padding so each starts on SMEM_ALIGN bytes (the
  library packs the tree back to back); returns (tree, real positions)."""
  tree, where, offset = [], [], 0
  for sd in buffers:
    if offset % SMEM_ALIGN:
      pad = SMEM_ALIGN - offset % SMEM_ALIGN
      tree.append(jax.ShapeDtypeStruct((pad,), np.uint8))
      offset += pad
    where.append(len(tree))
    tree.append(sd)
    offset += math.prod(sd.shape) * np.dtype(sd.dtype).itemsize
  if offset % MBARRIER_BYTES:
    pad = MBARRIER_BYTES - offset % MBARRIER_BYTES
    tree.append(jax.ShapeDtypeStruct((pad,), np.uint8))
  return tree, where


def _shapes(plan: GpuPlan):
  sds = jax.ShapeDtypeStruct
  ins = tuple(sds(a.shape, a.dtype) for a in plan.prefetch)
  ins += tuple(sds(b.mapping.array_aval.shape, b.mapping.array_aval.dtype)
               for b in plan.blocks if not b.is_output)
  outs = tuple(sds(b.mapping.array_aval.shape, b.mapping.array_aval.dtype)
               for b in plan.blocks if b.is_output)
  smem = [sds(b.buffer_shape, b.mapping.array_aval.dtype) for b in plan.blocks
          if not b.in_gmem]
  smem += [sds(s, d) for s, d in plan.scratch]
  smem += [sds(s, d) for _, bufs in plan.scoped for s, d in bufs]
  tree, where = _aligned(smem)
  tree.append(mgpu_core.TMABarrier(3))   # two pipeline slots, fixed blocks
  return ins, outs, tree, where


def build_gpu_module(spec) -> GpuModule:
  """The Mosaic GPU module of `spec`; must run inside an MLIR context made
  by `jax.interpreters.mlir.make_ir_context()` (as lowering rules do)."""
  plan = make_gpu_plan(spec)
  host = GpuHost(spec.name, spec.where)
  ins, outs, smem, where = _shapes(plan)
  semantics = mgpu_lib.LoweringSemantics.Warpgroup
  try:
    module, out_shapes, _, launch_ctx = mgpu_core._lower_as_gpu_kernel(
        _Emitter(spec, plan, host, where), (max(plan.cuda_grid, 1), 1, 1),
        (1, 1, 1), (WARPGROUP, 1, 1), ins, outs, (), smem, semantics,
        module_name=f"{spec.name}_mosaic_gpu", kernel_name=spec.name)
  except BackendError:
    raise
  except Exception as e:
    raise BackendError(spec.name, "the Mosaic GPU library rejected the "
                       "kernel while it was built" + TRITON_HINT + ": "
                       f"{type(e).__name__}: {e}", spec.where) from e
  text = str(module)
  try:
    mgpu_core.lower_mgpu_module(module, launch_ctx, semantics)
  except Exception as e:
    raise BackendError(spec.name, "the Mosaic GPU library could not infer "
                       "layouts for or lower the kernel" + TRITON_HINT + ": "
                       f"{type(e).__name__}: {e}", spec.where) from e
  return GpuModule(module, text, plan, tuple(out_shapes))


