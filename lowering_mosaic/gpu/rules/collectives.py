"""The multi-device primitives of a `plgpu.kernel` running inside
`shard_map` over GPUs with symmetric memory (Pallas's collectives): the
device index, semaphores in global memory and their signals to peers,
refs on a peer device, and NVLink multicast stores and reducing loads.

They build on jaxlib's Mosaic GPU library: the launch context knows the
device id (`device_id()`, read from the collective metadata) and maps a
global-memory ref to a peer's copy (`to_remote`) or to its multicast
address (`to_remote_multicast`); `SemaphoreRef` signals and waits. A
semaphore operation runs in one thread of the warpgroup, so under
Warpgroup semantics it is a `mosaic_gpu.custom_primitive` whose region is
lowered with Lane semantics (`lane_region`).
"""
from __future__ import annotations

import contextlib

from jax import lax
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from dsl.core.jax_internals import ir, mosaic_gpu_dialect as mgpu
from dsl.core.operand_layout import unpack
from dsl.core.state_scopes import get_global_p
from dsl.mosaic_gpu import multi_device as md
from dsl.tpu import primitives as tp
from lowering_mosaic.gpu import gmem_semaphores as gsem
from lowering_mosaic.gpu.device_ids import (as_i32, device_index,
                                            device_mesh, in_mesh_kernel,
                                            logical_device)
from lowering_mosaic.gpu.rules import TABLE
from lowering_mosaic.gpu.rules.memory import squeezed, window
from lowering_mosaic.gpu.rules.plgpu import parts


def _all_axes(ctx, collective_axes, what: str):
  names = tuple(device_mesh(ctx, what).axis_names)
  if set(collective_axes) != set(names):
    raise ctx.error(f"{what} takes collective_axes naming every axis of "
                    f"the device mesh {names}, got {tuple(collective_axes)}")


@contextlib.contextmanager
def lane_region(operands):
  """A `mosaic_gpu.custom_primitive` of `operands` (every value its body
  uses: the op is isolated from above), whose body is lowered with Lane
  semantics; yields the body's arguments."""
  op = mgpu.CustomPrimitiveOp(result=[], operands_=list(operands),
                              in_layouts=[], in_transforms=[], out_layouts=[])
  block = op.body.blocks.append(*[v.type for v in operands])
  with ir.InsertionPoint(block):
    yield list(block.arguments)
    mgpu.ReturnOp(operands_=[])


# ------------------------------------------------------------ semaphores

@TABLE.register(lax.axis_index_p)
def _axis_index(ctx, *, axis_name):
  in_mesh_kernel(ctx, f"lax.axis_index({axis_name!r})")
  mesh = ctx.host.jax_mesh
  known = () if mesh is None else tuple(mesh.axis_names)
  if axis_name not in known:
    raise ctx.error(f"lax.axis_index({axis_name!r}) names neither an axis "
                    "of the plgpu.kernel's mesh nor one of the device mesh "
                    f"{known} of the shard_map it runs in")
  return device_index(ctx, axis_name)


@TABLE.register(get_global_p)
def _get_global(ctx, *, what):
  in_mesh_kernel(ctx, "pl.get_global")
  # The call site's counters, for the rest of the launch.
  return ctx.host.semaphores.take(gsem.GLOBAL, what.shape)


def _semaphore(ctx, a) -> ir.Value:
  in_mesh_kernel(ctx, f"{ctx.eqn.primitive.name} (a semaphore in global "
                 "memory)")
  sem = window(ctx, a["sem"], a["sem_t"], static_ints=False)
  if ir.MemRefType(sem.type).shape:
    raise ctx.error("a semaphore operation takes one semaphore "
                    "(sems.at[i])")
  return sem


def _guarded(ctx):
  """The warpgroup's threads have finished what they did before (a
  signal's peer may read it at once)."""
  if ctx.host.auto_barriers:
    mgpu_utils.warpgroup_barrier()


@TABLE.register(tp.semaphore_signal_p)
def _semaphore_signal(ctx, *flat, layout, kind, device_id_type,
                      device_id_axes, mesh_axes):
  a, _ = parts(ctx, flat, layout)
  if a.get("barrier") is not None:
    raise ctx.error("the barrier semaphore (pltpu.get_barrier_semaphore) "
                    "is a TPU's; GPU kernels use plgpu.SemaphoreType.REGULAR")
  sem = _semaphore(ctx, a)
  if a["device_id"]:
    peer = logical_device(ctx, a["device_id"], device_id_type,
                          device_id_axes)
    sem = ctx.host.launch_ctx.to_remote(sem, peer)
  inc = as_i32(a["inc"])
  with lane_region([sem, inc, ctx.host.lane_predicate]) as (sem, inc, pred):
    ptr = mgpu_utils.memref_ptr(sem)
    _guarded(ctx)
    mgpu_utils.SemaphoreRef(ptr).signal(inc, predicate=pred,
                                        memory_scope="sys")
  return []


@TABLE.register(tp.semaphore_wait_p)
def _semaphore_wait(ctx, *flat, layout, kind, decrement=True, origin=None):
  a = unpack(flat, layout)
  if a.get("barrier") is not None:
    raise ctx.error("the barrier semaphore (pltpu.get_barrier_semaphore) "
                    "is a TPU's; GPU kernels use plgpu.SemaphoreType.REGULAR")
  sem = _semaphore(ctx, a)
  value = as_i32(a["value"])
  with lane_region([sem, value]) as (sem, value):
    mgpu_utils.SemaphoreRef(mgpu_utils.memref_ptr(sem)).wait(
        value, decrement=decrement, scope=mgpu_utils.ThreadSubset.WARPGROUP,
        memory_scope="sys")
  return []


@TABLE.register(md.semaphore_signal_multicast_p)
def _signal_multicast(ctx, *flat, layout, collective_axes):
  a = unpack(flat, layout)
  _all_axes(ctx, collective_axes, "plgpu.semaphore_signal_multicast")
  sem = _semaphore(ctx, a)
  value = as_i32(a["value"])
  multi = ctx.host.launch_ctx.to_remote_multicast(sem).ref
  with lane_region([multi, value, ctx.host.lane_predicate]) as (
      multi, value, pred):
    _guarded(ctx)
    mgpu_utils.SemaphoreRef.signal_multimem(mgpu_utils.memref_ptr(multi),
                                            value, predicate=pred)
  return []


# ------------------------------------------------------------ multimem

@TABLE.register(md.multimem_store_p)
def _multimem_store(ctx, *flat, layout, collective_axes):
  a = unpack(flat, layout)
  _all_axes(ctx, collective_axes, "plgpu.multimem_store")
  ref = squeezed(window(ctx, a["ref"], a["ref_t"], static_ints=False))
  multi = ctx.host.launch_ctx.to_remote_multicast(ref)
  if ctx.avals_in[0].shape:
    mgpu.vector_store(a["source"], multi.ref, optimized=False, multimem=True)
    return []
  # A scalar: one thread stores it.
  with lane_region([multi.ref, a["source"]]) as (m, v):
    mgpu_utils.MultimemRef(m).store(v, indices=[])
    _guarded(ctx)
  return []


def _reduction(ctx, op: str, dtype):
  """The library's name of a multimem reduction of `dtype`."""
  kinds = mgpu.MultimemLoadReductionType
  signed = mgpu_utils.is_signed(dtype)
  if op in ("min", "max"):
    prefix = {None: "", True: "s", False: "u"}[signed]
    return getattr(kinds, (prefix + op).capitalize())
  if op in ("add", "and", "or", "xor"):
    return getattr(kinds, op.capitalize())
  raise ctx.error(f"plgpu.multimem_load_reduce: unknown reduction {op!r}")


@TABLE.register(md.multimem_load_reduce_p)
def _multimem_load_reduce(ctx, *flat, layout, shape, collective_axes,
                          reduction_op):
  a = unpack(flat, layout)
  _all_axes(ctx, collective_axes, "plgpu.multimem_load_reduce")
  ref = squeezed(window(ctx, a["ref"], a["ref_t"], static_ints=False))
  kind = _reduction(ctx, reduction_op, ctx.avals_out[0].dtype)
  multi = ctx.host.launch_ctx.to_remote_multicast(ref)
  return mgpu.multimem_load_reduce(source=multi.ref, reduction_type=kind)

