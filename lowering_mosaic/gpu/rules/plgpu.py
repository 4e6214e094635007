"""The primitives of Pallas's Mosaic GPU API (`dsl.mosaic_gpu`, "plgpu") in
a `plgpu.kernel`: TMA copies between global and shared memory, mbarriers,
the fences and waits around them, as `mosaic_gpu` dialect ops and the
library's barrier refs (`DialectBarrierRef`: a barrier group, its phases
tracked per thread).

The refs of such a kernel: global-memory operands (memrefs), shared-memory
allocations (memrefs sliced from the kernel's shared memory) and barrier
groups; a ref's transforms (`x.at[...]`) select a window of it.
"""
from __future__ import annotations

import math

import numpy as np
from dsl.core.jax_internals import (arith, core, ir,
                                    mosaic_gpu_dialect as mgpu,
                                    state_indexing as indexing)
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.mosaic.gpu import layouts
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from dsl.core.access import SLICE, Axis, RefAccess, StartAlgebra, compose
from dsl.core.operand_layout import unpack
from dsl.mosaic_gpu import compute, primitives as plgpu_p
from dsl.mosaic_gpu.memory import (Layout, OOBFillMode, ParameterizedLayout,
                                   ReducedLayout)
from dsl.mosaic_gpu.multi_device import PeerMemRef
from lowering_mosaic.gpu.device_ids import peer_device
from lowering_mosaic.gpu.host import TRITON_HINT, i32, to_index, void_asm
from lowering_mosaic.gpu.mesh_accumulators import (acc_fence_p, wgmma_acc_p,
                                                   fenced)
from lowering_mosaic.gpu.rules import TABLE
from lowering_mosaic.gpu.rules.memory import window


def parts(ctx, args, layout):
  """The named operands of a packed primitive (integer literals among them
  as Python ints, which fold into the ops that use them), with their
  avals."""
  args = [int(v.val) if isinstance(v, core.Literal) and not v.aval.shape
          and np.issubdtype(v.aval.dtype, np.integer) else a
          for a, v in zip(args, ctx.eqn.invars)]
  return unpack(args, layout), unpack(ctx.avals_in, layout)


def _as_index(v) -> ir.Value:
  if isinstance(v, int):
    return arith.constant(ir.IndexType.get(), v)
  return to_index(v)


def _barrier(ctx, ref, transforms, shape):
  """One mbarrier of a group of `shape` (`barriers.at[i]`): the group at
  the row-major offset its indices select."""
  if not transforms:
    return ref
  if len(transforms) != 1 or not isinstance(transforms[0], indexing.NDIndexer):
    raise ctx.error("barriers are selected with indices (barriers.at[i, j])")
  offset = None
  strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
  for w, stride in zip(RefAccess.of(transforms[0], static=_known).dims,
                       strides):
    if w.kind == SLICE and w.stride != 1:
      raise ctx.error("barriers are not selected with strided slices")
    term = arith.muli(_as_index(_static(w.start)), _as_index(stride))
    offset = term if offset is None else arith.addi(offset, term)
  return ref[offset]


def _static(x):
  return x if isinstance(x, ir.Value) else int(x)


def _known(x) -> int | None:
  """An index's value when it is static (the access model's `static`)."""
  return None if isinstance(x, ir.Value) else int(x)


def _gmem_window(ctx, transforms, shape):
  """(indices (i32), slice lengths, peer) of the window of a global-memory
  ref that `transforms` select (-1: an integer-indexed, dropped dim; peer:
  the logical id of the device of a `plgpu.remote_ref`, or None)."""
  axes, fixed = tuple(Axis(d, None, 1, n) for d, n in enumerate(shape)), ()
  peer = None
  for t in transforms:
    if isinstance(t, PeerMemRef):
      peer = peer_device(ctx, t)
      continue
    if not isinstance(t, indexing.NDIndexer) or t.int_indexer_shape:
      raise ctx.error("only windows (x.at[...] with slices and indices) of "
                      "global-memory refs are copied by TMA" + TRITON_HINT)
    dims = RefAccess.of(t, [a.size for a in axes], static=_known).dims
    if any(w.kind == SLICE and w.stride != 1 for w in dims):
      raise ctx.error("strided windows are not copied by TMA" + TRITON_HINT)
    axes, fixed = compose(axes, fixed, dims, _STARTS,
                          lambda w, _: _static(w.start))
  starts = [None] * len(shape)
  lengths = list(shape)
  for a in axes:
    starts[a.dim], lengths[a.dim] = a.start, a.size
  for a in fixed:                 # an integer index drops the dim
    starts[a.dim], lengths[a.dim] = a.start, -1
  return starts, lengths, peer


def _add(a, b):
  if a is None:                   # no window placed the dim yet
    return b
  if isinstance(a, int) and isinstance(b, int):
    return a + b
  as_i32 = lambda v: i32(v) if isinstance(v, int) else _i32(v)
  return arith.addi(as_i32(a), as_i32(b))


# TMA windows have unit strides: a start only adds.
_STARTS = StartAlgebra(_add, lambda a, k: a)


def _i32(v):
  t = ir.IntegerType.get_signless(32)
  if isinstance(v.type, ir.IndexType):
    return arith.index_cast(t, v)
  return v


def _copy_indices(ctx, transforms, shape, box):
  """(indices, slice lengths, peer) of a TMA copy of the window of a
  global-memory ref of `shape` (on device `peer`, None: this one); `box`:
  the shared-memory side's shape."""
  if not transforms:
    zero = i32(0)
    return [zero] * len(box), list(box), None
  starts, lengths, peer = _gmem_window(ctx, transforms, shape)
  indices = [i32(s) if isinstance(s, int) else _i32(s)
             for s in (0 if s is None else s for s in starts)]
  return indices, lengths, peer


@TABLE.register(plgpu_p.copy_gmem_to_smem_p)
def _copy_gmem_to_smem(ctx, *args, layout, collective_axes, leader_tracked,
                       oob_mode):
  ops, avals = parts(ctx, args, layout)
  if collective_axes or leader_tracked is not None:
    raise ctx.error("collective (multicast) TMA copies do not lower yet"
                    + TRITON_HINT)
  if ops["predicate"]:
    raise ctx.error("predicated TMA copies do not lower yet" + TRITON_HINT)
  dst = window(ctx, ops["dst"], ops["dst_t"], static_ints=False)
  barrier = _barrier(ctx, ops["barrier"], ops["barrier_t"],
                     avals["barrier"].shape)
  box = ir.MemRefType(dst.type).shape
  indices, lengths, peer = _copy_indices(ctx, ops["src_t"],
                                         avals["src"].shape, box)
  nbytes = math.prod(box) * np.dtype(avals["src"].dtype).itemsize
  memref = barrier.as_barrier_memref()
  mgpu.arrive_expect_tx(memref, i32(nbytes))
  mode = OOBFillMode.ZEROS if oob_mode is None else oob_mode
  mgpu.async_load(ops["src"], dst, indices, lengths,
                  collective=ir.ArrayAttr.get([]), barrier=memref,
                  gmem_peer_id=peer,
                  oob_fill_mode=ir.IntegerAttr.get(
                      ir.IntegerType.get_signless(32), int(mode)))
  return []


@TABLE.register(plgpu_p.copy_smem_to_gmem_p)
def _copy_smem_to_gmem(ctx, *args, layout, commit_group, reduction_op):
  ops, avals = parts(ctx, args, layout)
  if ops["predicate"]:
    raise ctx.error("predicated TMA copies do not lower yet" + TRITON_HINT)
  src = window(ctx, ops["src"], ops["src_t"], static_ints=False)
  box = ir.MemRefType(src.type).shape
  indices, lengths, peer = _copy_indices(ctx, ops["dst_t"],
                                         avals["dst"].shape, box)
  reduction = None if reduction_op is None else getattr(
      mgpu.TMAReduction, reduction_op.capitalize())
  mgpu.async_store(src, ops["dst"], indices, lengths,
                   commit_group=commit_group, reduction_op=reduction,
                   gmem_peer_id=peer, is_global_broadcast=False)
  return []


def _the_barrier(ctx, args, layout):
  """The one mbarrier a barrier primitive names."""
  ops, avals = parts(ctx, args, layout)
  return _barrier(ctx, ops["barrier"], ops["barrier_t"],
                  avals["barrier"].shape)


@TABLE.register(plgpu_p.barrier_wait_p)
def _barrier_wait(ctx, *args, layout):
  _the_barrier(ctx, args, layout).wait()
  return []


@TABLE.register(plgpu_p.barrier_arrive_p)
def _barrier_arrive(ctx, *args, layout):
  _the_barrier(ctx, args, layout).arrive()
  return []


@TABLE.register(plgpu_p.commit_smem_p)
def _commit_smem(ctx):
  mgpu_utils.commit_shared()
  return []


@TABLE.register(plgpu_p.wait_smem_to_gmem_p)
def _wait_smem_to_gmem(ctx, *, n, wait_read_only):
  ctx.host.launch_ctx.await_async_copy(allow_groups=n,
                                       await_read_only=wait_read_only)
  return []


@TABLE.register(plgpu_p.commit_group_p)
def _commit_group(ctx):
  void_asm("cp.async.bulk.commit_group;")
  return []


# ------------------------------------------------------------- WGMMA

@TABLE.register(wgmma_acc_p)
def _wgmma_acc(ctx, *args, layout, a_is_ref):
  """`mosaic_gpu.wgmma` on the accumulator's value and the operands'
  shared memory (or `a` in registers), committed to a WGMMA group."""
  ops, _ = parts(ctx, args, layout)
  a = ops["a"]
  if a_is_ref:
    a = window(ctx, a, ops["a_t"], static_ints=False, transposes=True)
  b = window(ctx, ops["b"], ops["b_t"], static_ints=False, transposes=True)
  new = mgpu.wgmma(ops["acc"], a, b)
  void_asm("wgmma.commit_group.sync.aligned;")
  return new


@TABLE.register(acc_fence_p)
def _acc_fence(ctx, x):
  return fenced(x)


@TABLE.register(compute.wgmma_wait_p)
def _wgmma_wait(ctx, *, n):
  void_asm(f"wgmma.wait_group.sync.aligned {int(n)};")
  return []


@TABLE.register(compute.set_max_registers_p)
def _set_max_registers(ctx, *, n, action):
  verb = "inc" if action == "increase" else "dec"
  void_asm(f"setmaxnreg.{verb}.sync.aligned.u32 {int(n)};")
  return []


# ------------------------------------------------------------- layouts

# plgpu's register layouts the Mosaic GPU library names
_LAYOUTS = {
    Layout.WGMMA: fa.WGMMA_LAYOUT,
    Layout.WGMMA_TRANSPOSED: fa.WGMMA_TRANSPOSED_LAYOUT,
    Layout.WGMMA_8BIT: fa.WGMMA_LAYOUT_8BIT,
    Layout.WGMMA_UPCAST_2X: fa.WGMMA_LAYOUT_UPCAST_2X,
    Layout.WGMMA_UPCAST_4X: fa.WGMMA_LAYOUT_UPCAST_4X,
}


def _strided(shape, vec_size):
  # Lowered vectors have no unit dims; the layout maps the elements in
  # row-major order, so dropping them keeps each thread's elements.
  return fa.WGStridedFragLayout(tuple(d for d in shape if d != 1), vec_size)


# plgpu's layouts with arguments -> the library's layout of them
_PARAMETERIZED = {Layout.WG_STRIDED: _strided}


def _library_layout(ctx, layout):
  if isinstance(layout, ReducedLayout):
    return _library_layout(ctx, layout.layout).reduce(layout.axes)
  if (isinstance(layout, ParameterizedLayout)
      and layout.layout in _PARAMETERIZED):
    return _PARAMETERIZED[layout.layout](*layout.args, **dict(layout.kwargs))
  if layout not in _LAYOUTS:
    raise ctx.error(f"the register layout {layout} does not lower yet "
                    "(WGMMA layouts, their reductions and WG_STRIDED do)"
                    + TRITON_HINT)
  return _LAYOUTS[layout]


@TABLE.register(compute.layout_cast_p)
def _layout_cast(ctx, x, *, new_layout):
  return mgpu.layout_cast(
      x, layouts.to_layout_attr(_library_layout(ctx, new_layout)))
