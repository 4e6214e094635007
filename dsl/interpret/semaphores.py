"""Semaphores in a `plgpu.kernel`, as the warpgroup interpreter runs them:
int32 counters in global memory (`plgpu.SemaphoreType.REGULAR` scratch,
one per block; `pl.get_global`, one per call site for the launch), with a
copy on every device of the launch (dsl/interpret/devices.py).

- `pl.semaphore_signal(sem, inc)` adds `inc` when it is issued; with
  `device_id=...` it adds to the peer device's copy.
- `plgpu.semaphore_signal_multicast(sem, value, collective_axes=)` adds
  `value` to the copy on every device along `collective_axes`.
- `pl.semaphore_wait(sem, value)` pauses the warpgroup until the counter
  is at least `value`, then subtracts `value` (`decrement=False`: leaves
  it, as Pallas's collectives wait for a count of peers' signals). A wait
  that no signal can end is part of a deadlock: the scheduler reports
  every waiting warpgroup of every device, with its line.
- `pl.semaphore_read(sem)` is the counter's value.
"""
from __future__ import annotations

import numpy as np

from dsl.core.errors import BackendError
from dsl.core.operand_layout import unpack
from dsl.interpret.devices import multicast
from dsl.interpret.thread_eval import (TABLE, Blocked, on_device, read, where,
                                      write)
from dsl.mosaic_gpu import multi_device as md
from dsl.tpu import primitives as tp


def _semaphore(thread, eqn, a):
  """The semaphore cell of a signal or wait (not the TPU's barrier): the
  peer's copy through a `plgpu.remote_ref`, and the other transforms."""
  if a.get("barrier") is not None or a.get("sem") is None:
    raise BackendError(thread.kernel, "the barrier semaphore "
                       "(pltpu.get_barrier_semaphore) is a TPU's; plgpu "
                       "kernels use plgpu.SemaphoreType.REGULAR", where(eqn),
                       operand=eqn.primitive.name)
  return on_device(a["sem"], a["sem_t"])


def _add(cell, transforms, amount) -> None:
  old = read(cell, transforms, cell.label)
  write(cell, transforms, (old + np.int32(amount)).astype(np.int32),
        cell.label)


@TABLE.register(tp.semaphore_signal_p)
def _signal(thread, eqn, invals):
  a = unpack(invals, eqn.params["layout"])
  cell, t = _semaphore(thread, eqn, a)
  if a["device_id"]:
    mesh = thread.machine.memory.mesh
    if cell.copies is None:
      raise BackendError(thread.kernel, f"pl.semaphore_signal(device_id=...)"
                         f" of {cell.label}: only semaphores in global "
                         "memory have a copy on each device", where(eqn),
                         operand="device_id")
    peer = mesh.peer(thread.machine.device, a["device_id"],
                     eqn.params["device_id_type"],
                     eqn.params["device_id_axes"],
                     "pl.semaphore_signal(device_id=...)")
    cell = cell.copies.cells[peer]
  _add(cell, t, np.asarray(a["inc"]))
  _release(thread, cell)
  return []


def _release(thread, cell) -> None:
  races = thread.machine.memory.races
  if races is not None:
    races.release(thread, cell)


@TABLE.register(md.semaphore_signal_multicast_p)
def _signal_multicast(thread, eqn, invals):
  a, cells, t = multicast(thread, eqn, invals, "sem",
                          "plgpu.semaphore_signal_multicast")
  for cell in cells:
    _add(cell, t, np.asarray(a["value"]))
    _release(thread, cell)
  return []


@TABLE.register(tp.semaphore_wait_p)
def _wait(thread, eqn, invals):
  a = unpack(invals, eqn.params["layout"])
  cell, t = _semaphore(thread, eqn, a)
  value = int(np.asarray(a["value"]))

  def count() -> int:
    return int(read(cell, t, cell.label))
  if count() < value:
    yield Blocked(lambda: count() >= value,
                  f"waits for {cell.label} to reach {value} (it holds "
                  f"{count()})", eqn)
  if eqn.params.get("decrement", True):
    _add(cell, t, -value)
  races = thread.machine.memory.races
  if races is not None:
    races.acquire(thread, cell)
  return []


@TABLE.register(tp.semaphore_read_p)
def _read(thread, eqn, invals):
  a = unpack(invals, eqn.params["layout"])
  cell, t = _semaphore(thread, eqn, a)
  return np.asarray(read(cell, t, cell.label), np.int32)
