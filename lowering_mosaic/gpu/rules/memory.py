"""Ref reads and writes: `get`, `swap`, `addupdate` on shared memory.

Every ref a kernel sees is a shared-memory buffer (an operand's block, which
TMA fills and drains, or a scratch buffer). A window of it is a
`memref.subview`; whole-warpgroup reads and writes are `mosaic_gpu.
vector_load` / `vector_store` (layout inference picks how the 128 threads
share it); scalars are `memref.load` / `memref.store`.
"""
from __future__ import annotations

from dsl.core.jax_internals import (arith, ir, memref,
                                    mosaic_gpu_dialect as mgpu,
                                    state_indexing as indexing,
                                    state_primitives, state_types)
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.mosaic.gpu import layouts
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from dsl.core import config, dtypes, ref_ops
from dsl.core.access import SLICE, RefAccess
from dsl.core.operand_layout import ref_operands
from dsl.core.errors import source_info_frame
from dsl.mosaic_gpu.multi_device import PeerMemRef
from lowering_mosaic.gpu.device_ids import peer_device
from lowering_mosaic.gpu.rules import TABLE
from lowering_mosaic.gpu.smem_layout import memref_of
from lowering_mosaic.gpu.host import (TRITON_HINT, broadcast_to,
                                      is_vector, phys, to_index)
from lowering_mosaic.unchecked_windows import (ref_label, refusal,
                                               run_time_exits)


def _static(x):
  if isinstance(x, ir.Value):
    return x
  return int(x)


def _known(x) -> int | None:
  """An index's value when it is static (the access model's `static`)."""
  return None if isinstance(x, ir.Value) else int(x)


def window(ctx, ref: ir.Value, transforms, static_ints=True,
           transposes=False) -> ir.Value:
  """The subview of `ref` that its NDIndexer transforms select; with
  `static_ints=False`, integer indices are index values (Pallas's choice
  for plgpu refs: a subview at a run-time offset); with `transposes`,
  transposed views (`x.T`, for wgmma's operands) are `memref.transpose`.
  `ref.reshape(...)` is a reshaped view; `plgpu.remote_ref` the view on
  the peer device (the library's `to_remote`, after the other views)."""
  ref = memref_of(ref)
  peer = None
  for t in transforms or ():
    if transposes and isinstance(t, state_types.TransposeTransform):
      ref = mgpu_utils.memref_transpose(ref, tuple(t.permutation))
      continue
    if isinstance(t, state_types.ReshapeTransform):
      ref = mgpu_utils.memref_reshape(ref, tuple(t.shape))
      continue
    if isinstance(t, PeerMemRef):
      peer = peer_device(ctx, t)
      continue
    if not isinstance(t, indexing.NDIndexer):
      raise ctx.error(f"ref transform {type(t).__name__} is not supported by "
                      "the Mosaic GPU lowering" + TRITON_HINT)
    if t.int_indexer_shape:
      raise ctx.error("indexing a ref with an array of indices (a gather) is "
                      "not supported by the Mosaic GPU lowering" + TRITON_HINT)
    index = []
    shape = ir.MemRefType(ref.type).shape
    whole = True
    for w, n in zip(RefAccess.of(t, shape, static=_known).dims, shape):
      if w.kind == SLICE:
        if w.stride != 1:
          raise ctx.error("strided ref slices are not supported by the "
                          "Mosaic GPU lowering" + TRITON_HINT)
        start = _static(w.start)
        if isinstance(start, int):
          index.append(slice(start, start + w.size))
          whole &= start == 0 and w.size == n
        else:
          index.append(mgpu_utils.DynamicSlice(to_index(start), w.size))
          whole = False
      else:
        i = _static(w.start)
        if isinstance(i, int) and not static_ints:
          i = arith.constant(ir.IndexType.get(), i)
        index.append(i if isinstance(i, int) else to_index(i))
        whole = False
    if not whole:
      ref = mgpu_utils.memref_slice(ref, tuple(index))
  if peer is not None:
    ref = ctx.host.launch_ctx.to_remote(ref, peer)
  return ref


def squeezed(ref: ir.Value) -> ir.Value:
  """`ref` without its unit dims (a view): lowered values have none."""
  shape = ir.MemRefType(ref.type).shape
  if 1 in shape:
    ref = mgpu_utils.memref_slice(ref, tuple(0 if n == 1 else slice(None)
                                             for n in shape))
  return ref


def _zeros(ref):
  idx = arith.constant(ir.IndexType.get(), 0)
  return [idx] * len(ir.MemRefType(ref.type).shape)


def load(ref: ir.Value) -> ir.Value:
  """A whole-warpgroup read of `ref` (a scalar if it holds one element)."""
  if not phys(ir.MemRefType(ref.type).shape):
    return memref.load(ref, _zeros(ref))
  return mgpu.vector_load(squeezed(ref))


def store(ref: ir.Value, val: ir.Value) -> None:
  if not phys(ir.MemRefType(ref.type).shape):
    memref.store(val, ref, _zeros(ref))
    return
  ref = squeezed(ref)
  shape = tuple(ir.MemRefType(ref.type).shape)
  val = broadcast_to(val, shape)
  if len(shape) == 1 and shape[0] % 128 and shape[0] % 64 == 0:
    # A row vector of a 64-row tile (softmax statistics): the wgmma row
    # layout, as the row reductions that produce such values use.
    val = mgpu.layout_cast(val, layouts.to_layout_attr(fa.WGMMA_ROW_LAYOUT))
  mgpu.vector_store(val, ref)


def _window(ctx, args, params):
  """The ref primitive's operands by role, and the window they access.
  With runtime asserts on, a window placed at run time that the range
  analysis does not prove inside its ref is refused: the GPU cannot check
  it (lowering_mosaic.unchecked_windows)."""
  ops = ref_operands(ctx.eqn.primitive, args, params)
  _check_run_time_exits(ctx, ops)
  return ops, window(ctx, ops.ref, ops.transforms)


def _check_run_time_exits(ctx, ops) -> None:
  spec = ctx.host.spec
  if spec is None or not config.enable_runtime_assert():
    return
  shape = ir.MemRefType(memref_of(ops.ref).type).shape
  exits = run_time_exits(spec, ctx.eqn, ops.transforms, shape, _known)
  if exits:
    raise refusal(spec.name, "the Mosaic GPU lowering",
                  ref_label(spec, ctx.eqn.invars[0]), exits,
                  source_info_frame(ctx.eqn.source_info) or spec.where,
                  "backend='triton' or 'interpret'")


@TABLE.register(state_primitives.get_p)
def _get(ctx, *args, **params):
  return load(_window(ctx, args, params)[1])


@TABLE.register(state_primitives.swap_p)
def _swap(ctx, *args, **params):
  ops, view = _window(ctx, args, params)
  old = load(view) if ctx.out_used(0) else None
  store(view, ops.value)
  return old if old is not None else ops.value


@TABLE.register(state_primitives.addupdate_p)
def _addupdate(ctx, *args, **params):
  ops, view = _window(ctx, args, params)
  old = load(view)
  val = ops.value
  if is_vector(old):
    val = broadcast_to(val, phys(ctx.avals_in[1].shape))
  add = arith.addf if dtypes.is_float(ctx.avals_in[1].dtype) else arith.addi
  store(view, add(old, val))
  return []


def _unsupported(what):
  def rule(ctx, *args, **params):
    raise ctx.error(f"{what} cannot be expressed in the Mosaic GPU lowering"
                    + TRITON_HINT)
  return rule


TABLE.register(ref_ops.atomic_rmw_p, ref_ops.atomic_cas_p)(
    _unsupported("atomic operations"))


@TABLE.register(ref_ops.masked_load_p)
def _masked_load(ctx, *args, **params):
  ops = ref_operands(ctx.eqn.primitive, args, params)
  if ops.mask is not None:
    raise ctx.error("loads with a mask cannot be expressed in the Mosaic GPU "
                    "lowering (TMA fills out-of-bounds elements of edge "
                    "blocks with zeros; arbitrary masks need per-element "
                    "predication)" + TRITON_HINT)
  return load(window(ctx, ops.ref, ops.transforms))


@TABLE.register(ref_ops.masked_store_p)
def _masked_store(ctx, *args, **params):
  ops = ref_operands(ctx.eqn.primitive, args, params)
  if ops.mask is not None:
    raise ctx.error("stores with a mask cannot be expressed in the Mosaic GPU "
                    "lowering (TMA clips edge blocks; arbitrary masks need "
                    "per-element predication)" + TRITON_HINT)
  store(window(ctx, ops.ref, ops.transforms), ops.value)
  return []
