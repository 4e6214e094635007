"""A KernelSpec as a Mosaic GPU module (warpgroup semantics).

One CTA of one warpgroup (128 threads) runs one point of the parallel grid
dims (flattened into the CUDA grid's x axis). It loops over the sequential
dims; at each step it

  1. evaluates the index maps (scalar code) and copies every input block
     that changed GMEM -> SMEM with TMA, all on one mbarrier
     (`arrive_expect_tx` with the step's bytes, then `wait`);
  2. runs the kernel body on the SMEM blocks (vector code; layout inference
     spreads each vector over the warpgroup's registers);
  3. copies output blocks SMEM -> GMEM with TMA: after every step for blocks
     that move along the sequential dims, once after the loop for blocks
     revisited along them (those stay on chip, the accumulator pattern).

The module is the library's: `core._lower_as_gpu_kernel` builds the launch,
`core.lower_mgpu_module` runs layout inference and lowers the dialect.
"""
from __future__ import annotations

import dataclasses

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
from lowering_mosaic.gpu.plan import WARPGROUP, GpuPlan, make_gpu_plan


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


class _Emitter:
  def __init__(self, spec, plan: GpuPlan, host: GpuHost):
    self.spec, self.plan, self.host = spec, plan, host

  def block_offsets(self, block, ids) -> list[ir.Value]:
    """Element offsets (i32) of `block` at grid point `ids`."""
    bm = block.mapping
    closed = bm.index_map_jaxpr
    n_pf = len(closed.jaxpr.invars) - len(ids)
    idx = walk_jaxpr(self.host, closed.jaxpr, closed.consts,
                     list(ids) + [None] * n_pf)
    offs = []
    for i, n in zip(idx, bm.block_sizes):
      i = index_cast_i32(i)
      offs.append(arith.muli(i, i32(int(n))) if n != 1 else i)
    return offs

  def load(self, blocks, gmem, smem, barrier, ids):
    if not blocks:
      return
    barrier.arrive_expect_tx(sum(b.nbytes for b in blocks))
    for b in blocks:
      mgpu.async_load(source=gmem[b], destination=smem[b],
                      barrier=barrier.as_barrier_memref(),
                      indices=self.block_offsets(b, ids),
                      slice_lengths=list(b.slice_lengths),
                      collective=ir.ArrayAttr.get([]))
    barrier.wait()

  def store(self, blocks, gmem, smem, ids):
    if not blocks:
      return
    mgpu_utils.commit_shared()
    for b in blocks:
      mgpu.async_store(source=smem[b], destination=gmem[b],
                       indices=self.block_offsets(b, ids),
                       slice_lengths=list(b.slice_lengths))
    nvvm.cp_async_bulk_wait_group(0)
    mgpu_utils.warpgroup_barrier()

  def body(self, ids, refs):
    j = self.spec.jaxpr
    walk_jaxpr(self.host, j.jaxpr, j.consts, list(ids) + list(refs))

  def __call__(self, launch_ctx, *args):
    *gmem_refs, smem_tree = args
    plan = self.plan
    n_blocks = len(plan.blocks)
    smem_bufs = smem_tree[:n_blocks]
    scratch = smem_tree[n_blocks:-1]
    barrier = smem_tree[-1]
    gmem = dict(zip(plan.blocks, gmem_refs))
    smem = dict(zip(plan.blocks, smem_bufs))
    ins = [b for b in plan.blocks if not b.is_output]
    outs = [b for b in plan.blocks if b.is_output]
    grid = plan.grid
    flat = index_cast_i32(gpu.block_id(gpu.Dimension.x))
    par = _decode(flat, [grid[d] for d in plan.parallel])
    refs = list(smem_bufs) + list(scratch)

    def ids_at(seq_coords):
      ids = [None] * len(grid)
      for d, v in zip(plan.parallel, par):
        ids[d] = v
      for d, v in zip(plan.sequential, seq_coords):
        ids[d] = v
      return ids

    if plan.steps <= 1 and not plan.sequential:
      ids = ids_at([])
      self.load(ins, gmem, smem, barrier, ids)
      self.body(ids, refs)
      self.store(outs, gmem, smem, ids)
      return
    seq_sizes = [grid[d] for d in plan.sequential]
    idx = ir.IndexType.get()
    loop = scf.ForOp(*(arith.constant(idx, v) for v in (0, plan.steps, 1)))
    with ir.InsertionPoint(loop.body):
      step = index_cast_i32(loop.induction_variable)
      ids = ids_at(_decode(step, seq_sizes))
      self.load(ins, gmem, smem, barrier, ids)
      self.body(ids, refs)
      mgpu_utils.warpgroup_barrier()   # the blocks may be refilled next step
      self.store([b for b in outs if b.moves], gmem, smem, ids)
      scf.yield_([])
    last = ids_at([i32(n - 1) for n in seq_sizes])
    self.store([b for b in outs if not b.moves], gmem, smem, last)


def _shapes(plan: GpuPlan):
  sds = jax.ShapeDtypeStruct
  ins = tuple(sds(b.mapping.array_aval.shape, b.mapping.array_aval.dtype)
              for b in plan.blocks if not b.is_output)
  outs = tuple(sds(b.mapping.array_aval.shape, b.mapping.array_aval.dtype)
               for b in plan.blocks if b.is_output)
  smem = [sds(b.kernel_shape, b.mapping.array_aval.dtype) for b in plan.blocks]
  smem += [sds(s, d) for s, d in plan.scratch]
  smem.append(mgpu_core.TMABarrier(1))
  return ins, outs, smem


def build_gpu_module(spec) -> GpuModule:
  """The Mosaic GPU module of `spec`; must run inside an MLIR context made
  by `jax.interpreters.mlir.make_ir_context()` (as lowering rules do)."""
  plan = make_gpu_plan(spec)
  host = GpuHost(spec.name, spec.where)
  ins, outs, smem = _shapes(plan)
  semantics = mgpu_lib.LoweringSemantics.Warpgroup
  try:
    module, out_shapes, _, launch_ctx = mgpu_core._lower_as_gpu_kernel(
        _Emitter(spec, plan, host), (max(plan.cuda_grid, 1), 1, 1), (1, 1, 1),
        (WARPGROUP, 1, 1), ins, outs, (), smem, semantics,
        module_name=f"{spec.name}_mosaic_gpu", kernel_name=spec.name)
  except BackendError:
    raise
  except Exception as e:
    raise BackendError(spec.name, f"the Mosaic GPU library rejected the "
                       f"kernel while it was built: {type(e).__name__}: {e}"
                       + TRITON_HINT, spec.where) from e
  text = str(module)
  try:
    mgpu_core.lower_mgpu_module(module, launch_ctx, semantics)
  except Exception as e:
    raise BackendError(spec.name, "the Mosaic GPU library could not infer "
                       f"layouts for or lower the kernel: {type(e).__name__}: "
                       f"{e}" + TRITON_HINT, spec.where) from e
  return GpuModule(module, text, plan, tuple(out_shapes))


