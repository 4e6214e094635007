"""Ref reads and writes: `get`/`swap`/`addupdate` and masked loads/stores.

VMEM refs are read and written a vector at a time (`vector.load`,
`tpu.vector_store` (with a mask for masked stores), `tpu.strided_load/store`
for strided slices); SMEM refs a scalar at a time
(`memref.load`, `memref.store`). Refs in `pl.ANY` (HBM) are only reachable by
DMA, and semaphores only through the semaphore primitives.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from dsl.core.jax_internals import (arith, ir, memref,
                                    state_indexing as indexing,
                                    state_primitives, state_types, tpu,
                                    vector)

from dsl.core import config, ref_ops
from dsl.core.access import (INDEX, Axis, DimWindow, RefAccess, StartAlgebra,
                             compose)
from dsl.core.operand_layout import ref_operands
from lowering_mosaic import dialect
from lowering_mosaic.tpu import emit
from lowering_mosaic.tpu.host import RefVal, to_i32, to_index
from lowering_mosaic.tpu.rules import register
from lowering_mosaic.tpu.rules.integer import static_int
from lowering_mosaic.unchecked_windows import run_time_exits


@dataclasses.dataclass
class View:
  """A rectangular window of a ref: per ref dim, the access model's `Axis`
  (a start, int or i32 value; a size; a stride), and whether the dim is
  indexed away (`fixed`)."""
  ref: RefVal
  axes: tuple[Axis, ...]        # one per ref dim, in order
  fixed: frozenset = frozenset()

  @property
  def starts(self) -> list:
    return [a.start for a in self.axes]

  @property
  def sizes(self) -> list[int]:
    return [a.size for a in self.axes]

  @property
  def strides(self) -> list[int]:
    return [a.step for a in self.axes]

  @property
  def squeezed(self) -> list[bool]:
    return [a.dim in self.fixed for a in self.axes]

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(n for n, q in zip(self.sizes, self.squeezed) if not q)

  @property
  def load_shape(self) -> tuple[int, ...]:
    return tuple(self.sizes)

  @property
  def is_whole(self) -> bool:
    return (all(isinstance(s, int) and s == 0 for s in self.starts)
            and tuple(self.sizes) == self.ref.memref_shape
            and not any(self.squeezed) and all(s == 1 for s in self.strides))

  def index(self, dims) -> "View":
    """The view narrowed by an indexer's windows (one per shown dim),
    through the access model's one composition."""
    shown = [a for a in self.axes if a.dim not in self.fixed]
    shown, fixed = compose(shown, [a for a in self.axes
                                   if a.dim in self.fixed],
                           dims, _MLIR, _start_of)
    return View(self.ref, tuple(sorted(shown + fixed, key=lambda a: a.dim)),
                frozenset(a.dim for a in fixed))


_MLIR = StartAlgebra.folding(
    lambda a, b: arith.AddIOp(to_i32(a), to_i32(b)).result,
    lambda a, k: arith.MulIOp(to_i32(a), to_i32(k)).result)


def _static(x):
  """Static indices become ints; MLIR values stay."""
  return x if isinstance(x, ir.Value) else int(x)


def _known(x) -> int | None:
  """An index's value when the lowering knows it (a constant)."""
  x = _static(x)
  return x if isinstance(x, int) else static_int(x)


def _start_of(w: DimWindow, ax: Axis):
  """A window's start as an int or i32 value; a static negative integer
  index counts from the end."""
  i = _static(w.start)
  if w.kind == INDEX:
    c = _known(i)
    if c is not None and c < 0:
      i = c + ax.size
  return i


def _after_reshape(ctx, ref: RefVal, transforms):
  """(ref, transforms) with the last `ref.reshape` applied: the window
  before it becomes a memref of its own, and the transforms after it stay."""
  transforms = list(transforms or ())
  reshapes = [k for k, t in enumerate(transforms)
              if isinstance(t, state_types.ReshapeTransform)]
  if not reshapes:
    return ref, transforms
  k = reshapes[-1]
  return (_reshaped(ctx, ref, transforms[:k], transforms[k].shape),
          transforms[k + 1:])


def view_of(ctx, ref: RefVal, transforms) -> View:
  """Composes a ref's NDIndexer transforms into one window; a reshape
  (`ref.reshape`) makes the window before it a memref of its own first."""
  ref, transforms = _after_reshape(ctx, ref, transforms)
  v = View(ref, tuple(Axis(d, 0, 1, n)
                      for d, n in enumerate(ref.memref_shape)),
           frozenset(ref.hidden))
  for t in transforms or ():
    if not isinstance(t, indexing.NDIndexer):
      raise ctx.error(f"ref transform {type(t).__name__} is not supported by "
                      "the Mosaic lowering")
    if t.int_indexer_shape:
      raise ctx.error("indexing a ref with an array of indices (a gather) is "
                      "not supported on TPU; use slices and scalar indices")
    v = v.index(RefAccess.of(t, v.shape, static=_known).dims)
  return v


def window_memref(ctx, ref: RefVal, transforms) -> ir.Value:
  """The memref of a ref window: a `tpu.memref_slice` (+ `memref_squeeze`)
  per indexer, so chained `.at[]`s slice one after the other (as Pallas)."""
  ref, transforms = _after_reshape(ctx, ref, transforms)
  if len(transforms) <= 1:
    return _sliced(ctx, view_of(ctx, ref, transforms))
  for t in transforms:
    view = view_of(ctx, ref, [t])
    inner = ref.aval.inner_aval.update(shape=view.shape)
    ref = RefVal(_sliced(ctx, view), ref.aval.update(inner_aval=inner),
                 ref.space, ref.name)
  return ref.value


def _sliced(ctx, view: View) -> ir.Value:
  """The memref of one window: `tpu.memref_slice` (+ `memref_squeeze`)."""
  if view.is_whole:
    return view.ref.value
  if any(s != 1 for s in view.strides):
    raise ctx.error(f"a strided window of {view.ref.name or 'a ref'} cannot "
                    "be DMA'd, reshaped or used as a semaphore")
  t = ir.MemRefType(view.ref.value.type)
  sliced_t = ir.MemRefType.get(list(view.sizes), t.element_type,
                               memory_space=t.memory_space)
  x = tpu.MemRefSliceOp(sliced_t, view.ref.value,
                        [to_i32(s) for s in view.starts], []).result
  if any(view.squeezed):
    sq_t = ir.MemRefType.get(list(view.shape), t.element_type,
                             memory_space=t.memory_space)
    x = tpu.MemRefSqueezeOp(sq_t, x).result
  return x


def _reshaped(ctx, ref: RefVal, before, shape) -> RefVal:
  """`ref` with the transforms `before` applied, reshaped to `shape`: a
  `tpu.memref_reshape` of its window (as Pallas)."""
  what = f"{ref.name or 'a ref'}.reshape{tuple(shape)}"
  value = window_memref(ctx, ref, before) if before else ref.value
  t = ir.MemRefType(value.type)
  if len(t.shape) < 2 or len(shape) < 2:
    raise ctx.error(f"{what}: the Mosaic lowering reshapes refs of rank 2 "
                    "or more only, to rank 2 or more")
  if math.prod(t.shape) != math.prod(shape):
    raise ctx.error(f"{what}: a window of {tuple(t.shape)} has another "
                    "number of elements")
  if ref.space != dialect.VMEM:
    raise ctx.error(f"{what}: only VMEM refs can be reshaped in a kernel")
  target = ir.MemRefType.get(list(shape), t.element_type,
                             memory_space=t.memory_space)
  inner = ref.aval.inner_aval.update(shape=tuple(shape))
  return RefVal(tpu.MemRefReshapeOp(target, value).result,
                ref.aval.update(inner_aval=inner), ref.space, what)


def _check_reachable(ctx, ref: RefVal, verb: str):
  if ref.space == dialect.ANY:
    raise ctx.error(
        f"{ref.name or 'a ref'} is in pl.ANY (HBM) and cannot be {verb} "
        "directly by the kernel; copy it into a VMEM buffer with "
        "tpu.make_async_copy (or give it a blocked BlockSpec)")
  if ref.is_semaphore:
    raise ctx.error(f"{ref.name or 'a semaphore'} is a semaphore; use "
                    "tpu.semaphore_read / semaphore_signal / semaphore_wait")


def _indices(view: View):
  return [to_index(s) for s in view.starts]


def load(ctx, view: View) -> ir.Value:
  """Reads `view`; returns a value of shape `view.shape`."""
  ref = view.ref
  _check_reachable(ctx, ref, "read")
  dtype = ref.dtype
  if ref.space == dialect.SMEM or not ref.memref_shape:
    if math.prod(view.sizes) != 1:
      raise ctx.error(f"{ref.name or 'an SMEM ref'} is in SMEM, which is read "
                      "one scalar at a time; index it with integers")
    x = _from_memory(memref.LoadOp(ref.value, _indices(view)).result, (),
                     dtype)
    return emit.reshape(x, (), view.shape, dtype)
  t = emit.vtype(view.load_shape, _stored(dtype))
  if any(s != 1 for s in view.strides):
    x = tpu.StridedLoadOp(t, ref.value, _indices(view), view.strides).result
  else:
    x = vector.LoadOp(t, ref.value, _indices(view)).result
  # Booleans leave memory after the window's squeeze, as Pallas's do.
  x = emit.reshape(x, view.load_shape, view.shape, _stored(dtype))
  return _from_memory(x, view.shape, dtype)


def _stored(dtype):
  """The dtype a value of `dtype` has in memory (booleans: i32)."""
  return jnp.int32 if emit.is_bool(dtype) else dtype


def _from_memory(x, shape, dtype):
  if not emit.is_bool(dtype):
    return x
  return arith.CmpIOp(arith.CmpIPredicate.ne, x,
                      emit.zeros(shape, jnp.int32)).result


def _to_memory(x, shape, dtype):
  return emit.convert(x, shape, dtype, jnp.int32) if emit.is_bool(
      dtype) else x


def _element_bits(ref: RefVal) -> int:
  t = ir.MemRefType(ref.value.type).element_type
  return t.width if hasattr(t, "width") else ir.FloatType(t).width


def store(ctx, view: View, val: ir.Value, mask: ir.Value | None = None):
  """Writes `val` (shape `view.shape`, or a scalar) to `view`."""
  ref = view.ref
  _check_reachable(ctx, ref, "written")
  dtype = ref.dtype
  if ref.space == dialect.SMEM or not ref.memref_shape:
    if math.prod(view.sizes) != 1:
      raise ctx.error(f"{ref.name or 'an SMEM ref'} is in SMEM, which is "
                      "written one scalar at a time; index it with integers")
    if mask is not None:
      raise ctx.error("masked stores to SMEM are not supported")
    if emit.is_vector(val):
      val = emit.reshape(val, view.shape, (), dtype)
    memref.StoreOp(_to_memory(val, (), dtype), ref.value, _indices(view))
    return
  val = emit.broadcast_to(val, view.shape, dtype)
  # Booleans enter memory before the window's unsqueeze, as Pallas's do.
  val = _to_memory(val, view.shape, dtype)
  val = emit.reshape(val, view.shape, view.load_shape, _stored(dtype))
  if mask is not None:
    if _element_bits(ref) != 32:
      raise ctx.error(
          f"a masked store to {ref.name or 'a ref'} of {dtype}: TPUs store "
          "under a mask only 32-bit elements; store a 32-bit array, or "
          "write the window whole with jnp.where(mask, new, old) when it "
          "lies inside the ref")
    mask = emit.broadcast_to(mask, view.shape, "bool")
    mask = emit.reshape(mask, view.shape, view.load_shape, "bool")
    if any(s != 1 for s in view.strides):
      raise ctx.error("masked strided stores are not supported")
    tpu.VectorStoreOp(val, ref.value, _indices(view), [], mask=mask)
    return
  if any(s != 1 for s in view.strides):
    tpu.StridedStoreOp(val, ref.value, _indices(view), view.strides)
  else:
    tpu.VectorStoreOp(val, ref.value, _indices(view), [])


def _view(ctx, args, params):
  """The ref primitive's operands by role, and the view they access; with
  runtime asserts on, the access's run-time exits are noted (the TPU
  cannot check them: lowering_mosaic.unchecked_windows)."""
  ops = ref_operands(ctx.eqn.primitive, args, params)
  view = view_of(ctx, ops.ref, ops.transforms)
  if config.enable_runtime_assert():
    exits = run_time_exits(ctx.lctx.spec, ctx.eqn, ops.transforms,
                           ops.ref.shape, _known)
    if exits:
      ctx.lctx.unchecked_windows.append(
          (ops.ref.name, exits, ctx.lctx.current_line))
  return ops, view


@register(state_primitives.get_p)
def _get(ctx, *args, **params):
  _, view = _view(ctx, args, params)
  return load(ctx, view)


@register(state_primitives.swap_p)
def _swap(ctx, *args, **params):
  ops, view = _view(ctx, args, params)
  old = load(ctx, view) if ctx.out_used(0) else None
  store(ctx, view, ops.value)
  return old


@register(state_primitives.addupdate_p)
def _addupdate(ctx, *args, **params):
  ops, view = _view(ctx, args, params)
  old = load(ctx, view)
  val = emit.broadcast_to(ops.value, view.shape, ops.ref.dtype)
  add = arith.AddFOp if emit.is_float(ops.ref.dtype) else arith.AddIOp
  store(ctx, view, add(old, val).result)
  return []


@register(ref_ops.masked_load_p)
def _masked_load(ctx, *args, **params):
  ops, view = _view(ctx, args, params)
  x = load(ctx, view)
  if ops.mask is not None:
    dtype = ops.ref.dtype
    other = (ops.other if ops.other is not None
             else emit.zeros(view.shape, dtype))
    x = emit.select(ops.mask, x, emit.broadcast_to(other, view.shape, dtype))
  return x


@register(ref_ops.masked_store_p)
def _masked_store(ctx, *args, **params):
  ops, view = _view(ctx, args, params)
  store(ctx, view, ops.value, ops.mask)
  return []


@register(ref_ops.atomic_rmw_p, ref_ops.atomic_cas_p)
def _atomics(ctx, *args, **params):
  raise ctx.error("atomics do not exist on TPU (a kernel instance owns its "
                  "output blocks); accumulate in a VMEM scratch or an output "
                  "block revisited along an 'arbitrary' grid dim instead")
