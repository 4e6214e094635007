"""A KernelSpec as a Mosaic GPU module (warpgroup semantics).

A CTA runs `consumers` points of the parallel grid dims (flattened into
the CUDA grid's x axis; one point unless the schedule is warp-specialized)
and loops over the sequential dims. Its schedule (schedule.py, chosen by
plan.py) is one of:

  - one warpgroup: input blocks that stay put along the sequential dims are
    copied GMEM -> SMEM with TMA once, before the loop (`arrive_expect_tx`
    with their bytes on an mbarrier, then `wait`); blocks that move are
    double-buffered (step s runs on slot s % 2 while TMA fills the other
    slot with step s + 1's blocks), or copied at each step when only one
    slot fits; the body runs on the SMEM blocks; output blocks go SMEM ->
    GMEM with TMA after every step for blocks that move along the
    sequential dims, once after the loop for blocks revisited along them
    (those stay on chip: the accumulator pattern);
  - warp-specialized (specialized.py): a producer warpgroup fills a ring of
    slots, consumer warpgroups run the body.

The module is the library's: `core._lower_as_gpu_kernel` builds the launch,
`core.lower_mgpu_module` runs layout inference and lowers the dialect.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from dsl.core.jax_internals import (arith, gpu, ir, mosaic_gpu_dialect as mgpu,
                                    nvvm, scf)
from jax.experimental.mosaic import gpu as mgpu_lib
from jax.experimental.mosaic.gpu import core as mgpu_core
from jax.experimental.mosaic.gpu import launch_context as mgpu_lc
from jax.experimental.mosaic.gpu import utils as mgpu_utils
import jax

from dsl.core.errors import BackendError
from dsl.core.jaxpr_walk import walk_jaxpr
from lowering_mosaic.gpu import specialized
from lowering_mosaic.gpu.mesh_accumulators import fenced
from lowering_mosaic.gpu.host import (TRITON_HINT, GpuHost, constant,
                                      decode, i32, index_cast_i32)
from lowering_mosaic.gpu.rules import TABLE, memory as memory_rules
from lowering_mosaic.gpu.plan import (MBARRIER_BYTES, SMEM_ALIGN, SWIZZLE,
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


def _copies(block, buf, offsets):
  """(SMEM view, GMEM offsets, box) of each TMA copy of `block`."""
  copies = block.copies()
  if len(copies) == 1:
    return [(buf, offsets, list(block.slice_lengths))]
  d, bd = block.array_split_dim, block.split_dim
  out = []
  for start, n in copies:
    offs = list(offsets)
    offs[d] = arith.addi(offs[d], i32(start))
    lengths = list(block.slice_lengths)
    lengths[d] = n
    window = (slice(None),) * bd + (slice(start, start + n),)
    out.append((mgpu_utils.memref_slice(buf, window), offs, lengths))
  return out


def _stacked_copy(block, dest, offsets, indices):
  """(SMEM view, GMEM offsets, box) of the one TMA copy of a stacked
  block's replicas: in the array's `stacked_shape`, from the first
  replica's block (`indices`; `offsets` in elements) on, one block along
  the split dim per replica."""
  a = block.array_split_dim
  offs = list(offsets)
  offs[a:a + 1] = [indices[a], i32(0)]
  lengths = list(block.slice_lengths)
  lengths[a:a + 1] = [block.replicas, lengths[a]]
  return dest, offs, lengths


def _tiled(view, tiling):
  """`view` with the tiling and swizzle its TMA copies and loads use."""
  attrs = [mgpu_lc.TileTransform(tiling).to_attr(),
           mgpu.SwizzleTransformAttr.get(SWIZZLE)]
  return mgpu.with_transforms(view, ir.ArrayAttr.get(attrs))


class Emitter:
  """Emits one CTA of a kernel: the pieces every schedule uses."""

  def __init__(self, spec, plan: GpuPlan, host: GpuHost, where, offsets):
    self.spec, self.plan, self.host = spec, plan, host
    self.where = where     # positions of the buffers in the SMEM tree
    self.offsets = offsets  # their byte offsets
    self.prefetch = []     # the scalar-prefetch operands, read in GMEM

  # ---------------------------------------------------------- pieces

  def block_indices(self, block, ids) -> list[ir.Value]:
    """Block indices (i32) of `block` at grid point `ids`: its index map."""
    closed = block.mapping.index_map_jaxpr
    idx = walk_jaxpr(self.host, closed.jaxpr, closed.consts,
                     list(ids) + list(self.prefetch))
    return [index_cast_i32(i) for i in idx]

  def block_offsets(self, block, ids, indices=None) -> list[ir.Value]:
    """Element offsets (i32) of `block` at grid point `ids` (or of its
    block `indices`)."""
    if indices is None:
      indices = self.block_indices(block, ids)
    return [arith.muli(i, i32(int(n))) if n != 1 else i
            for i, n in zip(indices, block.mapping.block_sizes)]

  def view(self, block, slot=None, replica=None) -> ir.Value:
    """The kernel's ref of `block` in shared memory: ring slot `slot` (an
    index value) of replica `replica` (a consumer's; all of them if None)."""
    v = self.smem[block]
    if block.slots > 1:
      v = mgpu_utils.memref_slice(v, slot)
    if block.replicas > 1 and replica is not None:
      v = mgpu_utils.memref_slice(v, replica)
    return _tiled(v, block.tiling) if block.tiling else v

  def copy(self, block, dest, ids, barrier, predicate=None):
    """TMA of `block` at grid point `ids` into `dest`, completing on
    `barrier` (only where `predicate`, an i1, holds, if given); of a
    stacked block, of all its replicas (`ids` the first one's) into its
    slot."""
    indices = self.block_indices(block, ids)
    offsets = self.block_offsets(block, ids, indices)
    copies = (_copies(block, dest, offsets) if not block.stacked
              else [_stacked_copy(block, dest, offsets, indices)])
    for view, offs, lengths in copies:
      mgpu.async_load(source=self.gmem[block], destination=view,
                      barrier=barrier.as_barrier_memref(), indices=offs,
                      slice_lengths=lengths,
                      collective=ir.ArrayAttr.get([]), predicate=predicate)

  def issue(self, items, barrier, predicate=None):
    """Arms `barrier` with the bytes of `items` ((block, dest view, grid
    ids)) and starts their TMA copies; with a `predicate` (i1) they happen
    only where it holds (the barrier still completes a phase, with no
    bytes, where it does not)."""
    tx = i32(sum(b.nbytes for b, _, _ in items))
    if predicate is not None:
      tx = arith.select(predicate, tx, i32(0))
    barrier.arrive_expect_tx(tx)
    for b, dest, ids in items:
      self.copy(b, dest, ids, barrier, predicate)

  def load(self, items, barrier):
    if items:
      self.issue(items, barrier)
      barrier.wait()

  def store(self, items):
    """TMA of `items` ((block, source view, grid ids)) to global memory,
    waited for."""
    if not items:
      return
    mgpu_utils.commit_shared()
    for b, src, ids in items:
      for view, offs, lengths in _copies(b, src, self.block_offsets(b, ids)):
        mgpu.async_store(source=view, destination=self.gmem[b], indices=offs,
                         slice_lengths=lengths)
    nvvm.cp_async_bulk_wait_group(0)
    mgpu_utils.warpgroup_barrier()

  def body(self, ids, refs, carry=()) -> list:
    """Runs the kernel body at grid point `ids` on `refs`, the carried
    refs' places taken by their values `carry`; returns their new values
    (plan.body: accumulators.py)."""
    body = self.plan.body
    args = list(refs)
    for pos, value in zip(body.carried, carry):
      args[pos] = value
    return walk_jaxpr(self.host, body.jaxpr.jaxpr, body.jaxpr.consts,
                      list(ids) + args)

  def initial_carry(self) -> list:
    """The carried refs' values before the first step: those the kernel's
    hoisted initialization computes (initial_values.py), zeros for the
    others; the accumulators only WGMMAs write in the loop fenced once,
    here."""
    body = self.plan.body
    invars = body.jaxpr.jaxpr.invars
    rank = len(self.plan.grid)
    out = [constant(0, invars[rank + p].aval.shape,
                    invars[rank + p].aval.dtype)
           for p in body.carried]
    if body.initial is not None:
      values = walk_jaxpr(self.host, body.initial.jaxpr, body.initial.consts,
                          [])
      for k, value in zip(body.initialized, values):
        out[k] = value
    for k in body.tensor_core:
      out[k] = fenced(out[k])
    return out

  def steps_loop(self, carry, step) -> list:
    """An `scf.for` over the sequential steps carrying `carry`:
    `step(s, carry)` (s: the step, i32) emits one step and returns the new
    carry; returns the carry after the last step."""
    idx = ir.IndexType.get()
    loop = scf.ForOp(*(arith.constant(idx, v)
                       for v in (0, self.plan.steps, 1)), list(carry))
    args = list(loop.inner_iter_args)
    # Fenced before the loop; in it, only WGMMAs write them (rules/dot.py).
    self.host.fenced_carry = [args[k] for k in self.plan.body.tensor_core
                              if k < len(args)]
    with ir.InsertionPoint(loop.body):
      new = step(index_cast_i32(loop.induction_variable), args)
      scf.yield_(list(new))
    self.host.fenced_carry = []
    return list(loop.results)

  def write_back(self, carry, views):
    """The final values of the carried output blocks into their
    shared-memory `views` (their TMA stores follow)."""
    for pos, value in zip(self.plan.carried, carry):
      group, k = self.plan.ref_layout.locate(pos)
      if group == "blocks":
        memory_rules.store(views[self.plan.blocks[k]], value)

  def refs(self, views, replica=None):
    """The kernel's refs: prefetch, blocks (`views` for blocks in shared
    memory), scratch (None for scratch carried in registers); run_scoped
    buffers go to the host."""
    per = lambda buf: (mgpu_utils.memref_slice(buf, replica)
                       if self.plan.schedule.consumers > 1 else buf)
    for key, bufs in self.scoped:
      self.host.scoped[key] = [per(b) for b in bufs]
    scratch = dict(zip(self.plan.smem_scratch(), self.scratch))
    return (self.prefetch
            + [views.get(b, self.gmem[b]) for b in self.plan.blocks]
            + [per(scratch[i]) if i in scratch else None
               for i in range(len(self.plan.scratch))])

  def ids_at(self, par, seq_coords, replica: int | ir.Value = 0):
    """Grid ids from the CTA's parallel coordinates `par` (the split dim's
    its first consumer's: `_first_ids`; plus `replica`) and sequential
    coordinates."""
    plan = self.plan
    sched = plan.schedule
    ids = [None] * len(plan.grid)
    for d, v in zip(plan.parallel, par):
      if d == sched.split_dim and not (isinstance(replica, int)
                                       and replica == 0):
        r = replica if isinstance(replica, ir.Value) else i32(replica)
        v = arith.addi(v, r)
      ids[d] = v
    for d, v in zip(plan.sequential, seq_coords):
      ids[d] = v
    return ids

  # ---------------------------------------------------------- the CTA

  def __call__(self, launch_ctx, *args):
    *gmem_refs, smem_tree = args
    plan = self.plan
    prefetch, gmem_refs = plan.ref_layout.only("prefetch", "blocks").split(
        gmem_refs)
    self.prefetch = list(prefetch)
    self.gmem = dict(zip(plan.blocks, gmem_refs))
    on_chip = [b for b in plan.blocks if not b.in_gmem]
    buffers = [smem_tree[i] for i in self.where]
    self.smem = dict(zip(on_chip, buffers[:len(on_chip)]))
    rest = buffers[len(on_chip):]
    n_scratch = len(plan.smem_scratch())
    self.scratch, rest = rest[:n_scratch], rest[n_scratch:]
    self.scoped = []
    for key, bufs in plan.scoped:
      self.scoped.append((key, rest[:len(bufs)]))
      rest = rest[len(bufs):]
    if plan.reduction_bytes:
      self.host.reduction_scratch = (self.offsets[-1], plan.reduction_bytes)
    self.barriers = smem_tree[-1]
    sched = plan.schedule
    flat = index_cast_i32(gpu.block_id(gpu.Dimension.x))
    sizes = [plan.grid[d] // (sched.consumers if d == sched.split_dim else 1)
             for d in plan.parallel]
    self.par = self._first_ids(decode(flat, sizes))
    if sched.warp_specialized:
      specialized.emit(self)
    elif any(b.slots > 1 for b in on_chip):
      self._double_buffered()
    else:
      self._one_slot()

  def _first_ids(self, par):
    """The CTA's parallel coordinates `par` with the split dim's scaled by
    the consumers (its first consumer's grid id), once, before any loop."""
    sched = self.plan.schedule
    return [arith.muli(v, i32(sched.consumers))
            if d == sched.split_dim and sched.consumers > 1 else v
            for d, v in zip(self.plan.parallel, par)]

  def _seq_ids(self, s):
    sizes = [self.plan.grid[d] for d in self.plan.sequential]
    return self.ids_at(self.par, decode(s, sizes))

  def _last_ids(self):
    return self.ids_at(self.par, [i32(self.plan.grid[d] - 1)
                                  for d in self.plan.sequential])

  def _one_slot(self):
    """One slot per block: blocks that stay put are loaded once, blocks
    that move at each step (the copy waited for before the body runs);
    outputs that move are stored every step, the others once."""
    plan = self.plan
    ins = [b for b in plan.blocks if not b.in_gmem and not b.is_output]
    outs = [b for b in plan.blocks if not b.in_gmem and b.is_output]
    views = {b: self.view(b) for b in ins + outs}
    first = self._seq_ids(i32(0))
    self.load([(b, views[b], first) for b in ins if not b.moves],
              self.barriers[2])
    moving = [b for b in ins if b.moves]
    if plan.steps > 1:
      def step(s, carry):
        ids = self._seq_ids(s)
        self.load([(b, views[b], ids) for b in moving], self.barriers[0])
        carry = self.body(ids, self.refs(views), carry)
        mgpu_utils.warpgroup_barrier()   # the slot is refilled next step
        self.store([(b, views[b], ids) for b in outs if b.moves])
        return carry
      self.write_back(self.steps_loop(self.initial_carry(), step), views)
      outs = [b for b in outs if not b.moves]
      last = self._last_ids()
    else:
      self.load([(b, views[b], first) for b in moving], self.barriers[0])
      self.body(first, self.refs(views))
      last = first
    self.store([(b, views[b], last) for b in outs])

  def _double_buffered(self):
    """Inputs that move along the sequential dims rotate through two
    slots: step s computes on slot s % 2 while TMA fills the other slot
    with step s + 1's blocks (barrier per slot)."""
    plan = self.plan
    steps = plan.steps
    ins = [b for b in plan.blocks if not b.in_gmem and not b.is_output]
    outs = [b for b in plan.blocks if not b.in_gmem and b.is_output]
    piped = [b for b in ins if b.slots > 1]
    fixed = {b: self.view(b) for b in ins if b.slots == 1}
    out_views = {b: self.view(b) for b in outs}
    first = self._seq_ids(i32(0))
    self.load([(b, v, first) for b, v in fixed.items()], self.barriers[2])
    idx = ir.IndexType.get()

    def views(slot):
      return {b: self.view(b, slot) for b in piped}

    self.issue([(b, v, first) for b, v in
                views(arith.constant(idx, 0)).items()], self.barriers[0])
    def step(s, carry):
      slot = arith.remui(s, i32(2))
      other = arith.subi(i32(1), slot)
      nxt = arith.addi(s, i32(1))
      more = arith.cmpi(arith.CmpIPredicate.ult, nxt, i32(steps))
      nxt_ids = self._seq_ids(arith.minui(nxt, i32(steps - 1)))
      self.issue([(b, v, nxt_ids) for b, v in
                  views(arith.index_cast(idx, other)).items()],
                 self.barriers[other], more)
      self.barriers[slot].wait()
      ids = self._seq_ids(s)
      cur = views(arith.index_cast(idx, slot))
      carry = self.body(ids, self.refs({**fixed, **out_views, **cur}), carry)
      mgpu_utils.warpgroup_barrier()   # the slot is refilled next step
      self.store([(b, out_views[b], ids) for b in outs if b.moves])
      return carry

    self.write_back(self.steps_loop(self.initial_carry(), step), out_views)
    self.barriers[steps % 2].wait()    # the last, empty, prefetch
    last = self._last_ids()
    self.store([(b, out_views[b], last) for b in outs if not b.moves])


def _aligned(buffers):
  """`buffers` with uint8 padding so each starts on SMEM_ALIGN bytes (the
  library packs the tree back to back); returns (tree, positions of the
  buffers in it, their byte offsets)."""
  tree, where, starts, offset = [], [], [], 0
  for sd in buffers:
    if offset % SMEM_ALIGN:
      pad = SMEM_ALIGN - offset % SMEM_ALIGN
      tree.append(jax.ShapeDtypeStruct((pad,), np.uint8))
      offset += pad
    where.append(len(tree))
    starts.append(offset)
    tree.append(sd)
    offset += math.prod(sd.shape) * np.dtype(sd.dtype).itemsize
  if offset % MBARRIER_BYTES:
    pad = MBARRIER_BYTES - offset % MBARRIER_BYTES
    tree.append(jax.ShapeDtypeStruct((pad,), np.uint8))
  return tree, where, starts


def _tma_barriers(n: int):
  """`n` mbarriers that TMA copies complete: one arrival (the thread that
  arms them with `arrive_expect_tx`), the bytes doing the rest. (The
  library's `Barrier` with one arrival; jaxlib 0.12 dropped the separate
  `TMABarrier` it used to spell this with.)"""
  return mgpu_core.Barrier(arrival_count=1, num_barriers=n)


def _barriers(plan: GpuPlan):
  sched = plan.schedule
  if sched.warp_specialized:     # full, empty (one arrival per consumer)
    turns = [mgpu_core.Barrier(arrival_count=sched.consumers,
                               num_barriers=1)] if sched.turns else []
    return [_tma_barriers(sched.depth),
            mgpu_core.Barrier(arrival_count=sched.consumers,
                              num_barriers=sched.depth),
            _tma_barriers(1)] + turns
  return [_tma_barriers(3)]   # two pipeline slots, fixed blocks


def _shapes(plan: GpuPlan):
  sds = jax.ShapeDtypeStruct
  ins = tuple(sds(a.shape, a.dtype) for a in plan.prefetch)
  ins += tuple(sds(b.stacked_shape if b.stacked else b.mapping.array_aval.shape,
                   b.mapping.array_aval.dtype)
               for b in plan.blocks if not b.is_output)
  outs = tuple(sds(b.mapping.array_aval.shape, b.mapping.array_aval.dtype)
               for b in plan.blocks if b.is_output)
  tree, where, starts = _aligned([sds(s, d) for s, d in plan.smem_buffers()])
  barriers = _barriers(plan)
  tree.append(barriers[0] if len(barriers) == 1 else tuple(barriers))
  return ins, outs, tree, where, starts


def build_gpu_module(spec) -> GpuModule:
  """The Mosaic GPU module of `spec`; must run inside an MLIR context made
  by `jax.interpreters.mlir.make_ir_context()` (as lowering rules do)."""
  plan = make_gpu_plan(spec)
  host = GpuHost(spec.name, spec.where, TABLE)
  host.spec = spec
  ins, outs, smem, where, starts = _shapes(plan)
  semantics = mgpu_lib.LoweringSemantics.Warpgroup
  try:
    module, out_shapes, _, launch_ctx = mgpu_core._lower_as_gpu_kernel(
        Emitter(spec, plan, host, where, starts),
        (max(plan.cuda_grid, 1), 1, 1), (1, 1, 1),
        (plan.schedule.threads, 1, 1), ins, outs, (), smem, semantics,
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
