"""TPU kernel primitives: DMAs, semaphores and device ids.

(The TPU vector helpers `roll`, `repeat` and `bitcast` are in
`dsl.tpu.vector`.)

Each is a JAX primitive with an abstract eval and a state-discharge rule, so
the plain `"interpret"` backend runs it; `lowering_mosaic` gives it its TPU
meaning (`tpu.enqueue_dma`, `tpu.wait_dma2`, `tpu.sem_signal`, ...).

Semaphores are refs of int32 counters whose memory space is a
`SemaphoreSpace` (its `kind` is "dma", "regular" or "barrier"); a DMA
semaphore counts bytes, as on the hardware, so a wait takes back the size of
the copy it waits for.

Interpret-backend meaning (the discharge rules):

- a DMA completes at once: `dst[...] = src[...]` (`dst[...] += src[...]`
  for an accumulating one, `start(add=True)`), its semaphores go up by the
  number of bytes; a DMA wait takes them back down.
- `semaphore_signal` adds, `semaphore_wait` subtracts (nothing blocks); a
  wait, of either kind, whose semaphore is short of its count can never
  finish: dsl/transforms/runtime_checks.py makes it a KernelDeadlockError.
- remote DMAs and remote signals (`device_id=...`) inside `shard_map` are
  collectives: every device's source and target device id are all-gathered
  and each device keeps what was sent to it. So every device must execute
  the remote operation (not under a device-dependent `pl.when`), as in an
  SPMD program; for kernels where devices diverge, use the
  `"mosaic_interpret"` backend, which simulates devices independently.
- the barrier semaphore is a no-op: the discharged program runs in lockstep
  (`get_barrier_semaphore` gives a dummy handle, its signals and waits do
  nothing).
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax, tree_util
from dsl.core.jax_internals import (core, debugging, mlir, state_discharge,
                                    state_types)
from jax.extend.core import Primitive

from dsl.core.errors import KernelError, KernelTypeError, user_frame
from dsl.core.operand_layout import (effects as _effects_for, pack, position,
                                     ref_and_transforms as _ref_parts, unpack)
from dsl.core.semaphores import (BarrierSemaphore, DeviceIdType,
                                 get_barrier_semaphore,
                                 get_barrier_semaphore_p, is_semaphore_aval)
from dsl.core.tracing import grid_axis_names


def view_shape(ref, transforms):
  if transforms:
    return tuple(state_types.TransformedRef(ref, transforms).shape)
  return tuple(core.typeof(ref).shape)


def view_dtype(ref):
  return core.typeof(ref).dtype


def _sem_parts(what: str, sem):
  """(ref, transforms) of a semaphore argument, or (None, ()) for barrier."""
  if isinstance(sem, BarrierSemaphore):
    return None, ()
  ref, transforms = _ref_parts(what, sem)
  aval = core.typeof(ref)
  if not is_semaphore_aval(aval):
    raise KernelTypeError(
        None, f"{what} must be a semaphore (scratch_shapes entry "
        f"tpu.SemaphoreType.DMA / REGULAR, or get_barrier_semaphore()), got a "
        f"{aval.inner_aval.str_short()} ref in {aval.memory_space}",
        user_frame())
  shape = view_shape(ref, transforms)
  if shape != ():
    raise KernelError(None, f"{what} must select one semaphore, but it "
                      f"selects an array of shape {shape}; index it, e.g. "
                      "sem.at[slot]", user_frame())
  return ref, transforms


def semaphore_kind(ref) -> str:
  if ref is None:
    return "barrier"
  return core.typeof(ref).memory_space.kind


def _current_mesh_axes() -> tuple[tuple[Any, int], ...]:
  """The named axes (name, size) in scope, in order (shard_map's mesh)."""
  env, grid = core.get_axis_env(), grid_axis_names()
  return tuple((n, int(s)) for n, s in env.axis_sizes.items()
               if n not in grid)


def _normalize_device_id(device_id, device_id_type):
  """-> (values: tuple of int32 scalars, axes: tuple of names or None)."""
  if device_id is None:
    return (), None
  if isinstance(device_id_type, str):
    device_id_type = DeviceIdType(device_id_type)
  if isinstance(device_id, dict):
    if device_id_type is not DeviceIdType.MESH:
      raise KernelError(None, "a dict device_id names mesh axes and "
                        "needs device_id_type=DeviceIdType.MESH", user_frame())
    axes = tuple(device_id.keys())
    vals = tuple(jnp.asarray(device_id[a], jnp.int32) for a in axes)
    return vals, axes
  if isinstance(device_id, (tuple, list)):
    if device_id_type is DeviceIdType.LOGICAL and len(device_id) != 1:
      raise KernelError(None, "a LOGICAL device_id is one integer, got "
                        f"{len(device_id)} values", user_frame())
    return tuple(jnp.asarray(v, jnp.int32) for v in device_id), None
  return (jnp.asarray(device_id, jnp.int32),), None


# ------------------------------------------------------------ remote helpers

def logical_device_id(device_id, device_id_type, device_id_axes, mesh_axes,
                      index_of=lax.axis_index):
  """The linear id (row-major over the mesh) of a device_id, as a traced
  int32; axes missing from a dict device id keep this device's coordinate
  (`index_of(axis name)`: the warpgroup interpreter, which runs every
  device on the host, passes each device's own)."""
  vals = list(device_id)
  if device_id_type == DeviceIdType.LOGICAL or not mesh_axes:
    return vals[0] if vals else jnp.int32(0)
  names = [n for n, _ in mesh_axes]
  sizes = [s for _, s in mesh_axes]
  if device_id_axes is None:
    if len(vals) == 1 and len(names) > 1:
      # one coordinate for a multi-axis mesh: the last (minor) axis.
      coords = [index_of(n) for n in names[:-1]] + vals
    elif len(vals) != len(names):
      raise KernelError(None, f"device_id has {len(vals)} coordinates "
                        f"but the mesh has axes {names}", user_frame())
    else:
      coords = vals
  else:
    given = dict(zip(device_id_axes, vals))
    for a in given:
      if a not in names:
        raise KernelError(None, f"device_id names axis {a!r}, which is "
                          f"not a mesh axis ({names})", user_frame())
    coords = [given[n] if n in given else index_of(n) for n in names]
  lin = jnp.int32(0)
  for c, s in zip(coords, sizes):
    lin = lin * s + jnp.asarray(c, jnp.int32)
  return lin


def _my_logical_id(mesh_axes):
  lin = jnp.int32(0)
  for n, s in mesh_axes:
    lin = lin * s + lax.axis_index(n)
  return lin


def _mesh_names(mesh_axes, kernel_op):
  if not mesh_axes:
    raise KernelError(
        None, f"{kernel_op} with a device_id needs several devices: "
        "run the kernel inside jax.shard_map (or jit over a mesh) so that "
        "device ids mean something", None)
  names = tuple(n for n, _ in mesh_axes)
  return names if len(names) > 1 else names[0]


class _Exchange:
  """All-gathers over the mesh so that each device can pick what the device
  that targets it sent (at most one sender per remote operation)."""

  def __init__(self, target, mesh_axes, what):
    self.names = _mesh_names(mesh_axes, what)
    self.n = int(np.prod([s for _, s in mesh_axes]))
    all_tgt = self.gather(jnp.asarray(target, jnp.int32))
    hits = all_tgt == _my_logical_id(mesh_axes)
    self.count = jnp.sum(hits.astype(jnp.int32))
    self.sender = jnp.argmax(hits)

  def gather(self, x):
    x = jnp.asarray(x)
    return lax.all_gather(x, self.names, tiled=False).reshape(
        (self.n,) + x.shape)

  def from_sender(self, x):
    return self.gather(x)[self.sender]


# ------------------------------------------------------------ dma_start

dma_start_p = Primitive("dma_start")
dma_start_p.multiple_results = True


@dma_start_p.def_effectful_abstract_eval
def _dma_start_abstract_eval(*avals, layout, device_id_type, device_id_axes,
                             mesh_axes, priority, add):
  if add:       # an accumulating DMA reads what it adds to
    return [], _effects_for(layout, reads=("src", "dst"),
                            writes=("dst", "dst_sem", "src_sem"))
  return [], _effects_for(layout, reads=("src",),
                          writes=("dst", "dst_sem", "src_sem"))


def nbytes_of(shape, dtype):
  return int(np.prod(shape, dtype=np.int64)) * jnp.dtype(dtype).itemsize


def _sem_add(sem, transforms, amount):
  old = state_discharge.transform_array(sem, transforms)
  _, new = state_discharge.transform_swap_array(
      sem, transforms, (old + jnp.asarray(amount, old.dtype)).astype(old.dtype))
  return new


def _landed(old, data, add: bool):
  """What the destination window holds once a DMA of `data` lands."""
  if not add:
    return data
  if old.dtype == jnp.bool_:
    return jnp.logical_or(old, data)
  return (old + data).astype(old.dtype)


@state_discharge.register_discharge_rule(dma_start_p)
def _dma_start_discharge(ctx, *flat, layout, device_id_type, device_id_axes,
                         mesh_axes, priority, add):
  a = unpack(flat, layout)
  new = [None] * len(flat)
  val = state_discharge.transform_array(a["src"], a["src_t"])
  nbytes = nbytes_of(val.shape, val.dtype)
  remote = bool(a["device_id"])
  dst_t = a["dst_t"]
  if remote:
    target = logical_device_id(a["device_id"], device_id_type,
                               device_id_axes, mesh_axes)
    ex = _Exchange(target, mesh_axes, "make_async_remote_copy")
    # the window written is the sender's: take its indices and its data
    leaves, tree = tree_util.tree_flatten(dst_t)
    dst_t = tree_util.tree_unflatten(
        tree, [ex.from_sender(leaf) for leaf in leaves])
    received = ex.from_sender(val)
    old = state_discharge.transform_array(a["dst"], dst_t)
    val = jnp.where(ex.count > 0, _landed(old, received, add), old)
    recv_amount = ex.count * nbytes
  else:
    if add:
      val = _landed(state_discharge.transform_array(a["dst"], dst_t), val,
                    add)
    recv_amount = nbytes
  _, new_dst = state_discharge.transform_swap_array(a["dst"], dst_t, val)
  new[position(layout, "dst")] = new_dst
  dst_sem = _sem_add(a["dst_sem"], a["dst_sem_t"], recv_amount)
  if a["src_sem"] is not None:
    if a["src_sem"] is a["dst_sem"]:     # two cells of one semaphore array
      dst_sem = _sem_add(dst_sem, a["src_sem_t"], nbytes)
    else:
      new[position(layout, "src_sem")] = _sem_add(a["src_sem"],
                                                  a["src_sem_t"], nbytes)
  new[position(layout, "dst_sem")] = dst_sem
  return new, []


# ------------------------------------------------------------ dma_wait

dma_wait_p = Primitive("dma_wait")
dma_wait_p.multiple_results = True


# The waits take an optional `origin` param: the name of their semaphore,
# which the run-time-check pass (dsl.transforms.runtime_checks) gives them for
# its messages. JAX's own checkify rules (while_loop's) re-trace a body with
# it before the wait's check rule drops it, so the abstract evaluation and
# discharge of a wait accept it and ignore it.


@dma_wait_p.def_effectful_abstract_eval
def _dma_wait_abstract_eval(*avals, layout, side, device_id_type,
                            device_id_axes, mesh_axes, origin=None):
  return [], _effects_for(layout, reads=("sem",), writes=("sem",))


@state_discharge.register_discharge_rule(dma_wait_p)
def _dma_wait_discharge(ctx, *flat, layout, side, device_id_type,
                        device_id_axes, mesh_axes, origin=None):
  a = unpack(flat, layout)
  ref = a["dst"] if side != "send" else a["src"]
  t = a["dst_t"] if side != "send" else a["src_t"]
  view = state_discharge.transform_array(ref, t)
  new = [None] * len(flat)
  new[position(layout, "sem")] = _sem_add(a["sem"], a["sem_t"],
                                          -nbytes_of(view.shape, view.dtype))
  return new, []


# ------------------------------------------------------------ semaphores

semaphore_signal_p = Primitive("semaphore_signal")
semaphore_signal_p.multiple_results = True


@semaphore_signal_p.def_effectful_abstract_eval
def _signal_abstract_eval(*avals, layout, kind, device_id_type,
                          device_id_axes, mesh_axes):
  effs = _effects_for(layout, reads=("sem",), writes=("sem",))
  return [], effs | {debugging.debug_effect}


@state_discharge.register_discharge_rule(semaphore_signal_p)
def _signal_discharge(ctx, *flat, layout, kind, device_id_type,
                      device_id_axes, mesh_axes):
  a = unpack(flat, layout)
  new = [None] * len(flat)
  if a["sem"] is None:          # barrier semaphore: lockstep, nothing to do
    return new, []
  amount = jnp.asarray(a["inc"], jnp.int32)
  if a["device_id"]:
    target = logical_device_id(a["device_id"], device_id_type,
                               device_id_axes, mesh_axes)
    ex = _Exchange(target, mesh_axes, "semaphore_signal")
    all_tgt = ex.gather(target)
    me = _my_logical_id(mesh_axes)
    amount = jnp.sum(jnp.where(all_tgt == me, ex.gather(amount), 0)).astype(
        jnp.int32)
  new[position(layout, "sem")] = _sem_add(a["sem"], a["sem_t"], amount)
  return new, []


semaphore_wait_p = Primitive("semaphore_wait")
semaphore_wait_p.multiple_results = True


@semaphore_wait_p.def_effectful_abstract_eval
def _wait_abstract_eval(*avals, layout, kind, decrement=True, origin=None):
  effs = _effects_for(layout, reads=("sem",), writes=("sem",))
  return [], effs | {debugging.debug_effect}


@state_discharge.register_discharge_rule(semaphore_wait_p)
def _wait_discharge(ctx, *flat, layout, kind, decrement=True, origin=None):
  a = unpack(flat, layout)
  new = [None] * len(flat)
  if a["sem"] is None or not decrement:
    return new, []
  new[position(layout, "sem")] = _sem_add(
      a["sem"], a["sem_t"], -jnp.asarray(a["value"], jnp.int32))
  return new, []


semaphore_read_p = Primitive("semaphore_read")


@semaphore_read_p.def_effectful_abstract_eval
def _read_abstract_eval(*avals, layout, kind):
  return (core.ShapedArray((), jnp.int32),
          _effects_for(layout, reads=("sem",)))


@state_discharge.register_discharge_rule(semaphore_read_p)
def _read_discharge(ctx, *flat, layout, kind):
  a = unpack(flat, layout)
  if a["sem"] is None:
    return [None] * len(flat), jnp.int32(0)
  return [None] * len(flat), state_discharge.transform_array(a["sem"],
                                                             a["sem_t"])


# Barrier signals/waits have no ref operands, so they survive discharge as
# themselves: in the lockstep interpret backend they do nothing.
for _p in (semaphore_signal_p, semaphore_wait_p):
  _p.def_impl(lambda *a, **p: [])
  mlir.register_lowering(_p, lambda ctx, *a, **p: [])
semaphore_read_p.def_impl(lambda *a, **p: jnp.int32(0))


# ------------------------------------------------------------ barrier

def _barrier_handle(sem):
  """The `get_barrier_semaphore` value a barrier-semaphore operand carries
  (None for other semaphores)."""
  return sem.handle if isinstance(sem, BarrierSemaphore) else None


# ------------------------------------------------------------ user API

def _check_copy(src, src_t, dst, dst_t, what):
  s_shape, d_shape = view_shape(src, src_t), view_shape(dst, dst_t)
  s_dt, d_dt = view_dtype(src), view_dtype(dst)
  if s_shape != d_shape or s_dt != d_dt:
    raise KernelError(None, f"{what}: source {s_dt}{list(s_shape)} and "
                      f"destination {d_dt}{list(d_shape)} must have the same "
                      "shape and dtype", user_frame())


class AsyncCopyDescriptor:
  """A DMA from `src` to `dst` (on this device or, with `device_id`, on a
  peer), signalling `dst_sem` (on the receiving device) and, for remote
  copies, `src_sem` (here, once the source has been read)."""

  def __init__(self, src_ref, dst_ref, dst_sem, src_sem=None, device_id=None,
               device_id_type=DeviceIdType.MESH):
    self.src, self.src_t = _ref_parts("the DMA source", src_ref)
    self.dst, self.dst_t = _ref_parts("the DMA destination", dst_ref)
    what = ("make_async_remote_copy" if device_id is not None
            else "make_async_copy")
    _check_copy(self.src, self.src_t, self.dst, self.dst_t, what)
    self.dst_sem, self.dst_sem_t = _sem_parts(
        "the receive semaphore" if device_id is not None else "the DMA "
        "semaphore", dst_sem)
    if self.dst_sem is None:
      raise KernelTypeError(None, "a DMA cannot signal the barrier "
                            "semaphore; use a SemaphoreType.DMA scratch",
                            user_frame())
    if src_sem is not None:
      self.src_sem, self.src_sem_t = _sem_parts("the send semaphore", src_sem)
    else:
      self.src_sem, self.src_sem_t = None, ()
    if isinstance(device_id_type, str):
      device_id_type = DeviceIdType(device_id_type)
    self.device_id_type = device_id_type
    self.device_id, self.device_id_axes = _normalize_device_id(
        device_id, device_id_type)
    self.mesh_axes = _current_mesh_axes() if device_id is not None else ()

  @property
  def is_remote(self) -> bool:
    return bool(self.device_id)

  def _common(self):
    return dict(device_id_type=self.device_id_type,
                device_id_axes=self.device_id_axes, mesh_axes=self.mesh_axes)

  def start(self, priority: int = 0, *, add: bool = False):
    """Starts the copy; with `add=True` the data is added to what `dst`
    holds when it lands (an accumulating DMA)."""
    flat, layout = pack(src=self.src, src_t=self.src_t, dst=self.dst,
                         dst_t=self.dst_t, dst_sem=self.dst_sem,
                         dst_sem_t=self.dst_sem_t, src_sem=self.src_sem,
                         src_sem_t=self.src_sem_t, device_id=self.device_id)
    dma_start_p.bind(*flat, layout=layout, priority=int(priority),
                     add=bool(add), **self._common())
    return self

  def _wait(self, sem, sem_t, side):
    """Waits on `sem` (one of the copy's semaphores); `peer_sem` is the
    copy's other one (None for a local copy), which a lowering may name."""
    device_id = self.device_id if side != "local" else ()
    peer, peer_t = ((self.dst_sem, self.dst_sem_t) if side == "send" else
                    (self.src_sem, self.src_sem_t) if side == "recv" else
                    (None, ()))
    flat, layout = pack(sem=sem, sem_t=sem_t, src=self.src, src_t=self.src_t,
                         dst=self.dst, dst_t=self.dst_t, device_id=device_id,
                         peer_sem=peer, peer_sem_t=peer_t)
    dma_wait_p.bind(*flat, layout=layout, side=side, **self._common())

  def wait(self):
    """Waits for the copy: both ends for a remote copy."""
    if self.is_remote:
      if self.src_sem is not None:
        self.wait_send()
      self.wait_recv()
    else:
      self._wait(self.dst_sem, self.dst_sem_t, "local")

  def wait_recv(self):
    """Waits until the data has landed (on the receiving device)."""
    self._wait(self.dst_sem, self.dst_sem_t,
               "recv" if self.is_remote else "local")

  def wait_send(self):
    """Waits until the source has been read (on the sending device)."""
    if self.src_sem is None:
      raise KernelError(None, "wait_send needs a send semaphore; use "
                        "make_async_remote_copy(src, dst, send_sem, recv_sem, "
                        "device_id=...)", user_frame())
    self._wait(self.src_sem, self.src_sem_t, "send")


def make_async_copy(src_ref, dst_ref, sem) -> AsyncCopyDescriptor:
  """A local DMA `src_ref -> dst_ref` that signals `sem`; `.start()`, `.wait()`."""
  return AsyncCopyDescriptor(src_ref, dst_ref, sem)


def async_copy(src_ref, dst_ref, sem, *, priority: int = 0, add: bool = False):
  """Starts a local DMA (accumulating with `add=True`) and returns its
  descriptor (call `.wait()` on it)."""
  return make_async_copy(src_ref, dst_ref, sem).start(priority=priority,
                                                      add=add)


def make_async_remote_copy(src_ref, dst_ref, send_sem, recv_sem, device_id,
                           device_id_type=DeviceIdType.MESH
                           ) -> AsyncCopyDescriptor:
  """A DMA from this device's `src_ref` into `dst_ref` on device `device_id`.

  `send_sem` (here) is signalled when the source has been read, `recv_sem`
  (on the receiver) when the data has landed. `device_id` is a tuple of mesh
  coordinates, a dict {axis name: coordinate} (with `DeviceIdType.MESH`), or
  one integer with `DeviceIdType.LOGICAL`.
  """
  return AsyncCopyDescriptor(src_ref, dst_ref, recv_sem, src_sem=send_sem,
                             device_id=device_id,
                             device_id_type=device_id_type)


def semaphore_signal(sem, inc=1, *, device_id=None,
                     device_id_type=DeviceIdType.MESH, core_index=None):
  """Adds `inc` to `sem`, on this device or on device `device_id`."""
  if core_index is not None:
    raise KernelError(None, "semaphore_signal(core_index=...) is not "
                      "supported: one TensorCore per device", user_frame())
  ref, t = _sem_parts("semaphore_signal's semaphore", sem)
  if isinstance(device_id_type, str):
    device_id_type = DeviceIdType(device_id_type)
  dev, axes = _normalize_device_id(device_id, device_id_type)
  flat, layout = pack(sem=ref, sem_t=t, inc=jnp.asarray(inc, jnp.int32),
                       device_id=dev, barrier=_barrier_handle(sem))
  semaphore_signal_p.bind(*flat, layout=layout, kind=semaphore_kind(ref),
                          device_id_type=device_id_type, device_id_axes=axes,
                          mesh_axes=_current_mesh_axes() if dev else ())


def semaphore_wait(sem, value=1, *, decrement=True):
  """Waits until `sem` is at least `value`, then subtracts `value`
  (`decrement=False`: leaves the count, as GPU collectives do with the
  signals of peer devices)."""
  ref, t = _sem_parts("semaphore_wait's semaphore", sem)
  flat, layout = pack(sem=ref, sem_t=t, value=jnp.asarray(value, jnp.int32),
                       barrier=_barrier_handle(sem))
  semaphore_wait_p.bind(*flat, layout=layout, kind=semaphore_kind(ref),
                        decrement=bool(decrement))


def semaphore_read(sem):
  """The current value of `sem` (an int32 scalar)."""
  ref, t = _sem_parts("semaphore_read's semaphore", sem)
  flat, layout = pack(sem=ref, sem_t=t, barrier=_barrier_handle(sem))
  return semaphore_read_p.bind(*flat, layout=layout, kind=semaphore_kind(ref))


# ------------------------------------------------------------ device ids

def device_id():
  """This device's logical id inside `shard_map` (row-major over the mesh)."""
  axes = _current_mesh_axes()
  if not axes:
    return jnp.int32(0)
  return _my_logical_id(axes)

