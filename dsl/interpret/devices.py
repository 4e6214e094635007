"""The devices of a `plgpu.kernel` launch that talks to other devices
(Pallas's collectives), as the warpgroup interpreter runs it inside
`shard_map`: every device's blocks and warpgroups run together on the
host (dsl.core.device_launch gathers the operands of every device into
one run), each device with its own global memory.

- The devices are the shard_map's mesh (`DeviceMesh`), numbered row-major
  as `pltpu.device_id` and Pallas's GPU lowering number them;
  `lax.axis_index` of a mesh axis is the device's coordinate.
- A ref in global memory (the kernel's operands, its semaphores, the
  refs of `pl.get_global`) has a copy on every device (`Copies`);
  `plgpu.remote_ref(ref, device_id)` reaches the peer's copy, so TMA
  copies and stores through it land in the peer's memory when issued.
- `plgpu.multimem_store` writes every copy along its `collective_axes`;
  `plgpu.multimem_load_reduce` reads every copy along them and reduces
  ("add", "min", "max", "and", "or", "xor").
- Semaphores and their signals to peers: dsl/interpret/semaphores.py;
  races between devices: dsl/interpret/device_races.py.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from jax import lax

from dsl.core.device_launch import num_devices
from dsl.core.errors import BackendError
from dsl.core.jaxpr_walk import sub_jaxprs
from dsl.core.operand_layout import unpack
from dsl.core.semaphores import DeviceIdType
from dsl.interpret.device_races import DeviceRaces
from dsl.interpret.plgpu_rules import REDUCTIONS
from dsl.interpret.thread_eval import TABLE, Cell, on_device, read, where, write
from dsl.mosaic_gpu import multi_device as md
from dsl.tpu import primitives as tp


class DeviceMesh:
  """The devices of a launch: the shard_map mesh's axes ((name, size),
  ...); device `d` is the row-major linear index of its coordinates."""

  def __init__(self, axes=()):
    self.axes = tuple((n, int(s)) for n, s in axes)
    self.names = tuple(n for n, _ in self.axes)
    self.size = num_devices(self.axes)

  def coords(self, device: int) -> dict:
    out, rest = {}, device
    for name, size in reversed(self.axes):
      out[name] = rest % size
      rest //= size
    return out

  def device_of(self, coords: dict) -> int:
    lin = 0
    for name, size in self.axes:
      lin = lin * size + coords[name]
    return lin

  def check_axes(self, thread, eqn, axes, what: str) -> None:
    missing = [a for a in axes if a not in self.names]
    if missing:
      raise BackendError(thread.kernel, f"{what} names the device axes "
                         f"{missing}, which are not axes of the shard_map "
                         f"mesh {self.names} the kernel runs in (run it "
                         "inside jax.shard_map over them)", where(eqn),
                         operand=eqn.primitive.name)

  def group(self, thread, eqn, axes, what: str) -> list[int]:
    """The devices along `axes` from the thread's (its own among them)."""
    self.check_axes(thread, eqn, axes, what)
    mine = self.coords(thread.machine.device)
    return [d for d in range(self.size)
            if all(self.coords(d)[n] == mine[n] for n in self.names
                   if n not in axes)]

  def peer(self, device: int, values, device_id_type, axes=None,
           what: str = "device_id") -> int:
    """The device a `device_id` names (one int if LOGICAL; else mesh
    coordinates, of `axes` or all; missing axes keep `device`'s)."""
    if not self.axes:
      raise ValueError(f"{what} needs the kernel to run inside "
                       "jax.shard_map over a mesh of devices")
    coords = self.coords(device)
    lin = int(np.asarray(tp.logical_device_id(
        [np.asarray(v).reshape(()) for v in values], device_id_type, axes,
        self.axes, index_of=lambda n: np.int32(coords[n]))))
    if not 0 <= lin < self.size:
      raise ValueError(f"{what} names device {lin}, outside the "
                       f"{self.size} devices of the mesh {self.axes}")
    return lin


class Copies:
  """The copies of one allocation in global memory, one per device;
  `races`: where accesses of them are checked (None: they are not)."""
  __slots__ = ("cells", "mesh", "races")

  def __init__(self, cells: list[Cell], mesh: DeviceMesh,
               races: DeviceRaces | None = None):
    self.cells, self.mesh, self.races = cells, mesh, races
    for c in cells:
      c.copies = self

  def device_of(self, cell: Cell) -> int:
    return next(d for d, c in enumerate(self.cells) if c is cell)

  def on_peer(self, cell: Cell, peer: md.PeerMemRef) -> Cell:
    """The copy a `plgpu.remote_ref(cell, device_id)` reaches."""
    ids = peer.device_id
    values, axes = ((list(ids.values()), tuple(ids)) if isinstance(ids, dict)
                    else ([ids], None))
    return self.cells[self.mesh.peer(self.device_of(cell), values,
                                     peer.device_id_type, axes,
                                     f"plgpu.remote_ref({cell.label})")]


class GlobalMemory:
  """The global memory of every device of a launch: the kernel's
  operands (`share`: their accesses checked for races between devices,
  dsl/interpret/device_races.py) and, per key, the copies of one
  semaphore allocation (`cell`), made on every device at once."""

  def __init__(self, mesh: DeviceMesh, kernel: str = ""):
    self.mesh = mesh
    self.copies: dict = {}
    self.races = DeviceRaces(kernel) if mesh.size > 1 else None

  def share(self, cells: list[Cell]) -> list[Cell]:
    """`cells` (one per device) as the copies of one operand."""
    Copies(cells, self.mesh, self.races)
    return cells

  def cell(self, key, device: int, make: Callable[[], Cell]) -> Cell:
    copies = self.copies.get(key)
    if copies is None:
      copies = self.copies[key] = Copies(
          [make() for _ in range(self.mesh.size)], self.mesh)
    return copies.cells[device]


def multicast(thread, eqn, invals, ref: str, what: str):
  """The operands of a multicast primitive (`what`), the copy of its ref
  `ref` on each device along its `collective_axes`, and the ref's
  transforms left."""
  a = unpack(invals, eqn.params["layout"])
  cell, transforms = on_device(a[ref], a[ref + "_t"])
  devices = thread.machine.memory.mesh.group(
      thread, eqn, eqn.params["collective_axes"], what)
  if cell.copies is None:
    raise BackendError(thread.kernel, f"{what} of {cell.label}: only refs "
                       "in global memory have a copy on each device",
                       where(eqn), operand=eqn.primitive.name)
  return a, [cell.copies.cells[d] for d in devices], transforms


@TABLE.register(lax.axis_index_p)
def _axis_index(thread, eqn, invals):
  name = eqn.params["axis_name"]
  mesh = thread.machine.memory.mesh
  mesh.check_axes(thread, eqn, (name,), f"lax.axis_index({name!r})")
  return np.int32(mesh.coords(thread.machine.device)[name])


@TABLE.register(md.multimem_store_p)
def _multimem_store(thread, eqn, invals):
  a, cells, t = multicast(thread, eqn, invals, "ref", "plgpu.multimem_store")
  for cell in cells:
    write(cell, t, a["source"], cell.label)
  return []


@TABLE.register(md.multimem_load_reduce_p)
def _multimem_load_reduce(thread, eqn, invals):
  _, cells, t = multicast(thread, eqn, invals, "ref",
                          "plgpu.multimem_load_reduce")
  combine = REDUCTIONS[eqn.params["reduction_op"].lower()]
  values = [read(cell, t, cell.label) for cell in cells]
  out = values[0]
  for v in values[1:]:
    out = combine(out, v)
  return np.asarray(out, values[0].dtype)


# ------------------------------------------------------ which kernels talk

def _talks(eqn, kernel_axes) -> bool:
  if eqn.primitive is lax.axis_index_p:
    return eqn.params["axis_name"] not in kernel_axes
  if eqn.primitive is tp.semaphore_signal_p:
    return bool(eqn.params["mesh_axes"] or eqn.params["device_id_type"]
                is not DeviceIdType.MESH)
  if eqn.primitive in (md.multimem_store_p, md.multimem_load_reduce_p,
                       md.semaphore_signal_multicast_p):
    return True
  layout = eqn.params.get("layout")
  if layout is None:
    return False
  return any(isinstance(t, md.PeerMemRef)
             for part in unpack(eqn.invars, layout).values()
             if isinstance(part, tuple) for t in part)


def talks_to_devices(jaxpr, kernel_axes) -> bool:
  """Whether a kernel jaxpr reads its device's index or reaches another
  device (so it runs with every device of its shard_map together).
  `kernel_axes`: the names of the `plgpu.kernel`'s own mesh."""
  for eqn in jaxpr.eqns:
    if _talks(eqn, kernel_axes):
      return True
    if any(talks_to_devices(sub, kernel_axes)
           for sub in sub_jaxprs(eqn.params)):
      return True
  return False
