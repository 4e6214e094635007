"""TPU primitives -> the Mosaic `tpu` dialect: DMAs, semaphores, devices.

The DMA and semaphore structure of a module (what the Promela export
reads) is:

  %src_view = tpu.memref_slice %src[%i, %j]      (+ tpu.memref_squeeze)
  %sem      = tpu.memref_slice %sems[%k] + tpu.memref_squeeze
              -> memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
  tpu.enqueue_dma source(%src_view) target(%dst_view)
                  [source_semaphore(%send_sem)] target_semaphore(%sem)
                  [device_id(%dev)]            remote copies name the device
  tpu.wait_dma source(%src_view) target(%dst_view)          (jax 0.12)
               [source_semaphore(%send_sem)] target_semaphore(%sem)
               [device_id(%dev)] {wait_target = true | false}
                                 the whole copy; wait_target: the receive
                                 side (false: the send side of a remote copy)
  tpu.wait_dma2 semaphore(%sem) src(%src_view) dst(%dst_view) [device_id(%dev)]
                                               (jax 0.11) waits for the bytes
  tpu.wait_dma2 semaphore(%send_sem) src(%dst_view) dst(%src_view)
                device_id(%c0) core_id(%c0)    the send side of a remote copy
  tpu.sem_signal %sem, %amount [device_id %dev]
  tpu.sem_wait %sem, %value
  %v = tpu.sem_read %sem
  %b = tpu.sem_barrier          the kernel's barrier semaphore
  %d = tpu.device_id            this device's logical id (row-major over the
                                mesh; `lax.axis_index` is computed from it)
  %n = tpu.iteration_bound 1    the size of grid dim 1 (`pl.num_programs(1)`
                                of a dim whose size is traced)

A DMA semaphore counts bytes: a DMA adds the size of its copy when it lands
(and, for remote copies, to the send semaphore when the source has been
read); a wait waits for and takes back the size of the copy. Which form a
wait takes follows the installed Pallas (`DMA_WAIT_NAMES_COPY` in
dsl/core/jax_internals.py): `wait_dma` awaits the target semaphore
(`wait_target = true`) or the source semaphore (`false`); with `wait_dma2`,
as in Pallas 0.11, the wait on the receive semaphore of a remote copy
carries the copy's `device_id` and the wait on the send semaphore names the
copy's ends swapped and carries device and core id 0.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from dsl.core.jax_internals import (DEVICE_COORDINATES_UNSIGNED,
                                    DMA_WAIT_NAMES_COPY, arith, cf, checkify,
                                    core, ir, lax_parallel, tpu)

from dsl.core import primitives as dsl_primitives
from dsl.core.dynamic_grid import num_programs_p
from dsl.tpu import primitives as tp
from dsl.tpu import vector as tpu_vector
from dsl.core.semaphores import DeviceIdType
from dsl.core.operand_layout import unpack
from lowering_mosaic import dialect
from lowering_mosaic.tpu import emit
from lowering_mosaic.tpu.host import RefVal, i32_const, to_i32
from lowering_mosaic.tpu.rules import register
from lowering_mosaic.tpu.rules.memory import window_memref


def memref_view(ctx, ref: RefVal, transforms) -> ir.Value:
  """The memref of a ref window (`memory.window_memref`)."""
  return window_memref(ctx, ref, transforms)


def _barrier_semaphore(ctx) -> ir.Value:
  ctx.lctx.uses_barrier = True
  return tpu.GetBarrierSemaphoreOp(
      dialect.semaphore_memref_type((), "regular")).result


@register(num_programs_p)
def _num_programs(ctx, *, axis):
  """The size of a dynamic grid dim, where the kernel asks for it (as
  Pallas)."""
  return tpu.GetIterationBoundOp(axis).result


@register(tp.get_barrier_semaphore_p)
def _get_barrier_semaphore(ctx, *, tag):
  """`tpu.sem_barrier` where `get_barrier_semaphore()` is called (as
  Pallas); the signals and waits on it use this value."""
  return _barrier_semaphore(ctx)


def _semaphore(ctx, ref, transforms, barrier=None) -> ir.Value:
  """The semaphore operand: a window of a semaphore ref, or the barrier
  semaphore (`barrier`: the `get_barrier_semaphore` value, if it was taken
  in the kernel)."""
  if ref is not None:
    return memref_view(ctx, ref, transforms)
  if isinstance(barrier, ir.Value) and isinstance(barrier.type, ir.MemRefType):
    return barrier
  return _barrier_semaphore(ctx)


# ------------------------------------------------------------ device ids

def _mesh(ctx, mesh_axes):
  axes = tuple(mesh_axes) or tuple(ctx.lctx.mesh_axes)
  return axes


def _strides(mesh_axes):
  sizes = [s for _, s in mesh_axes]
  strides, acc = [], 1
  for s in reversed(sizes):
    strides.append(acc)
    acc *= s
  return list(reversed(strides))


def _my_coordinate(ctx, mesh_axes, name) -> ir.Value:
  names = [n for n, _ in mesh_axes]
  if name not in names:
    raise ctx.error(f"axis {name!r} is not a mesh axis ({names}); run the "
                    "kernel inside shard_map over a mesh with that axis")
  k = names.index(name)
  dev = tpu.DeviceIdOp().result
  stride, size = _strides(mesh_axes)[k], mesh_axes[k][1]
  # as the installed Pallas computes it (DEVICE_COORDINATES_UNSIGNED)
  div, rem = ((arith.DivUIOp, arith.RemUIOp) if DEVICE_COORDINATES_UNSIGNED
              else (arith.DivSIOp, arith.RemSIOp))
  q = div(dev, i32_const(stride)).result if stride != 1 else dev
  return rem(q, i32_const(size)).result


def device_id_value(ctx, values, device_id_type, device_id_axes,
                    mesh_axes) -> ir.Value:
  """The logical device id (i32) named by a device_id operand."""
  values = [to_i32(v) for v in values]
  if device_id_type == DeviceIdType.LOGICAL:
    return values[0]
  mesh_axes = _mesh(ctx, mesh_axes)
  if not mesh_axes:
    if len(values) == 1:
      return values[0]
    raise ctx.error("a mesh device_id needs the kernel to run inside "
                    "shard_map (no mesh is known)")
  names = [n for n, _ in mesh_axes]
  if device_id_axes is not None:
    given = dict(zip(device_id_axes, values))
    coords = [given[n] if n in given else _my_coordinate(ctx, mesh_axes, n)
              for n in names]
  elif len(values) == len(names):
    coords = values
  elif len(values) == 1:
    coords = [_my_coordinate(ctx, mesh_axes, n) for n in names[:-1]] + values
  else:
    raise ctx.error(f"device_id has {len(values)} coordinates but the mesh "
                    f"has axes {names}")
  lin = None
  for c, stride in zip(coords, _strides(mesh_axes)):
    term = c if stride == 1 else arith.MulIOp(c, i32_const(stride)).result
    lin = term if lin is None else arith.AddIOp(lin, term).result
  return lin


@register(lax_parallel.axis_index_p)
def _axis_index(ctx, *, axis_name):
  mesh_axes = tuple(ctx.lctx.mesh_axes)
  if not mesh_axes:
    raise ctx.error("lax.axis_index needs the kernel to run inside shard_map "
                    "(the mesh gives the device coordinates)")
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  ctx.lctx.named_axes.update(str(n) for n in names)
  sizes = dict(mesh_axes)
  lin = None
  for n in names:
    c = _my_coordinate(ctx, mesh_axes, n)
    lin = c if lin is None else arith.AddIOp(
        arith.MulIOp(lin, i32_const(sizes[n])).result, c).result
  return lin


# ------------------------------------------------------------ DMAs

@register(tp.dma_start_p)
def _dma_start(ctx, *flat, layout, device_id_type, device_id_axes, mesh_axes,
               priority, add):
  if add:
    # Pallas's TPU lowering rejects it (NotImplementedError) too: the
    # TensorCore's `tpu.enqueue_dma` has no accumulating form.
    raise ctx.error(
        "an accumulating DMA (start(add=True), sync_copy(add=True)) has no "
        "TensorCore form (tpu.enqueue_dma only copies); DMA into a VMEM "
        "scratch, wait, and add with a load and a store instead")
  # Pallas's order: the device id, then the views from the last operand to
  # the first (pure ops; the same order keeps the modules comparable)
  a = unpack(flat, layout)
  dev = None
  if a["device_id"]:
    ctx.lctx.uses_remote = True
    dev = device_id_value(ctx, a["device_id"], device_id_type,
                          device_id_axes, mesh_axes)
  src_sem = (_semaphore(ctx, a["src_sem"], a["src_sem_t"])
             if a["src_sem"] is not None else None)
  dst_sem = _semaphore(ctx, a["dst_sem"], a["dst_sem_t"])
  dst = memref_view(ctx, a["dst"], a["dst_t"])
  src = memref_view(ctx, a["src"], a["src_t"])
  tpu.EnqueueDMAOp(src, dst, source_semaphore=src_sem,
                   target_semaphore=dst_sem, device_id=dev,
                   priority=priority or None)
  return []


@register(tp.dma_wait_p)
def _dma_wait(ctx, *flat, layout, side, device_id_type, device_id_axes,
              mesh_axes):
  """A wait for one end of a DMA, in the installed Pallas's form
  (`DMA_WAIT_NAMES_COPY`)."""
  a = unpack(flat, layout)

  def device():
    return device_id_value(ctx, a["device_id"], device_id_type,
                           device_id_axes, mesh_axes) if a["device_id"] \
        else None
  if DMA_WAIT_NAMES_COPY:
    _wait_dma(ctx, a, side, device())
  else:
    _wait_dma2(ctx, a, side, device)
  return []


def _wait_dma(ctx, a, side, dev):
  """`tpu.wait_dma` naming the whole copy: its ends, both semaphores (the
  send semaphore where it has one), its device, and the end awaited
  (`wait_target`: the receive side; a send waits for its source)."""
  send = side == "send"
  src_sem, dst_sem = ((a["sem"], a["sem_t"]), (a["peer_sem"], a["peer_sem_t"]))
  if not send:
    src_sem, dst_sem = dst_sem, src_sem
  # Pallas's order: the views from the last operand to the first
  src_sem = (_semaphore(ctx, *src_sem) if src_sem[0] is not None else None)
  dst_sem = _semaphore(ctx, *dst_sem)
  dst = memref_view(ctx, a["dst"], a["dst_t"])
  src = memref_view(ctx, a["src"], a["src_t"])
  tpu.WaitDMAOp(src, dst, not send, source_semaphore=src_sem,
                target_semaphore=dst_sem, device_id=dev)


def _wait_dma2(ctx, a, side, device):
  """`tpu.wait_dma2` naming the semaphore awaited: a receive waits with the
  copy's device id; a send waits with src and dst swapped and device and
  core id 0 (the sender's own side); a local copy without either."""
  first, second = ("dst", "src") if side == "send" else ("src", "dst")
  dev = core_id = None
  if side == "send":
    dev = core_id = i32_const(0)
  else:
    dev = device()
  sem = _semaphore(ctx, a["sem"], a["sem_t"])
  dst = memref_view(ctx, a[second], a[second + "_t"])
  src = memref_view(ctx, a[first], a[first + "_t"])
  tpu.WaitDMA2Op(sem, src, dst, device_id=dev, core_id=core_id)


# ------------------------------------------------------------ semaphores

@register(tp.semaphore_signal_p)
def _sem_signal(ctx, *flat, layout, kind, device_id_type, device_id_axes,
                mesh_axes):
  a = unpack(flat, layout)
  sem = _semaphore(ctx, a["sem"], a["sem_t"], a.get("barrier"))
  dev = None
  if a["device_id"]:
    ctx.lctx.uses_remote = True
    dev = device_id_value(ctx, a["device_id"], device_id_type,
                          device_id_axes, mesh_axes)
  tpu.SemaphoreSignalOp(sem, to_i32(a["inc"]), device_id=dev)
  return []


@register(tp.semaphore_wait_p)
def _sem_wait(ctx, *flat, layout, kind, decrement=True):
  if not decrement:
    raise ctx.error("semaphore_wait(decrement=False) (a wait that leaves "
                    "the count) does not lower on a TPU: Mosaic's "
                    "tpu.sem_wait always decrements")
  a = unpack(flat, layout)
  sem = _semaphore(ctx, a["sem"], a["sem_t"], a.get("barrier"))
  tpu.SemaphoreWaitOp(sem, to_i32(a["value"]))
  return []


@register(tp.semaphore_read_p)
def _sem_read(ctx, *flat, layout, kind):
  a = unpack(flat, layout)
  sem = _semaphore(ctx, a["sem"], a["sem_t"], a.get("barrier"))
  return tpu.SemaphoreReadOp(sem).result


# ------------------------------------------------------------ vector helpers

def _rotate_amount(ctx, shift, n: int):
  """The rotate amount in [0, n): `shift` mod n (a static int when the shift
  is a constant, else an i32 value)."""
  atom = ctx.eqn.invars[1]
  if isinstance(atom, core.Literal):
    return int(atom.val) % n
  shift = to_i32(shift)
  size = i32_const(n)
  r = arith.RemSIOp(shift, size).result           # in (-n, n)
  return arith.RemSIOp(arith.AddIOp(r, size).result, size).result


@register(tpu_vector.roll_p)
def _roll(ctx, x, shift, *, axis, stride, stride_axis):
  """`tpu.dynamic_rotate` by the shift taken mod the axis length (negative
  shifts and shifts of n or more are the same rotation); a static shift of
  0 mod n without a stride is the identity."""
  n = ctx.avals_in[0].shape[axis]
  amount = _rotate_amount(ctx, shift, n)
  kw = {}
  if stride is not None:
    kw = dict(stride=stride, stride_dimension=stride_axis)
  elif isinstance(amount, int) and amount == 0:
    return x
  if isinstance(amount, int):
    amount = i32_const(amount)
  return tpu.DynamicRotateOp(x, amount, axis, **kw).result


@register(tpu_vector.repeat_p)
def _repeat(ctx, x, *, repeats, axis):
  # `repeats` copies side by side, as Pallas lowers `jnp.tile` (jaxlib 0.12
  # has no `tpu.repeat`)
  if repeats == 1:
    return x
  return tpu.ConcatenateOp([x] * repeats, axis).result


@register(tpu_vector.bitcast_p)
def _bitcast(ctx, x, *, ty):
  out = ctx.out_aval
  return tpu.BitcastOp(emit.vtype(out.shape, out.dtype), x).result


# ------------------------------------------------------------ hints, debug

@register(dsl_primitives.multiple_of_p)
def _multiple_of(ctx, x, *, values):
  aval = ctx.avals_in[0]
  if aval.shape == () and jnp.issubdtype(aval.dtype, jnp.integer) and len(
      values) == 1:
    return tpu.AssumeMultipleOp(x, int(values[0])).result
  return x


@register(dsl_primitives.max_contiguous_p, core.pvary_p, core.reduced_vary_cast_p)
def _identity(ctx, *args, **params):
  if ctx.eqn.primitive.multiple_results:
    return list(args)
  return args[0]


@register(dsl_primitives.debug_print_p)
def _debug_print(ctx, *args, fmt):
  tpu.LogOp(list(args), fmt, formatted=True)
  return []


@register(checkify.check_p)
def _check(ctx, *args, err_tree, debug, **params):
  """A run-time check (dsl/core/checks.py says which are) becomes `cf.assert`
  on the negated error flag, with the check's message."""
  if debug:
    return []       # debug-only checks are dropped, as without checkify
  error = jax.tree_util.tree_unflatten(err_tree, list(args))
  messages = []
  for md in error._metadata.values():
    try:
      exc = jax.tree_util.tree_unflatten(md, [None] * md.num_leaves)
      messages.append(str(getattr(exc, "fmt_string", exc)))
    except Exception:  # noqa: BLE001 - a message is a courtesy
      messages.append("check failed")
  message = "; ".join(messages) or "check failed"
  for failed in error._pred.values():
    true = arith.ConstantOp(failed.type, ir.IntegerAttr.get(failed.type, 1))
    ok = arith.XOrIOp(failed, true.result).result
    cf.AssertOp(ok, message)
  return []
