"""Races between the devices of a `plgpu.kernel` launch (the warpgroup
interpreter's multi-device run, dsl/interpret/devices.py).

A store into a peer's memory (`plgpu.remote_ref` copies,
`plgpu.multimem_store`) or a read of it (`plgpu.multimem_load_reduce`)
lands when the interpreter issues it, but on the hardware nothing orders
it with what the peer does unless a synchronization does: a semaphore
signal made after it and a wait that sees that signal (or an mbarrier
arrival and a wait for its phase, within a device). So each warpgroup
carries a vector clock: a signal or an arrival releases it into the
semaphore or barrier, a wait acquires what was released there. Each
element of a kernel operand remembers its last store and its last read
(which warpgroup, at which line, at which of its clock's ticks); an access
from another device that is not ordered after them is a race
(`KernelRaceError`, naming both lines), and so is a peer's access of a
device's memory that is not ordered before that device's kernel ends (the
device may return, and its memory be reused, while the access is in
flight): the missing wait of a collective.

Only accesses of different devices are checked: warpgroups of one device
share its memory as the single-device interpreter models it.
"""
from __future__ import annotations

import numpy as np

from dsl.core.errors import KernelRaceError
from dsl.interpret.thread_eval import Cell, read, running, where, write


def _join(into: dict, other: dict) -> None:
  for k, v in other.items():
    if into.get(k, 0) < v:
      into[k] = v


class _Shadow:
  """Per element of one copy of an operand: its last store and last read
  (a site index, -1 for none, and the accessor's tick)."""

  def __init__(self, shape):
    self.store = Cell(np.full(shape, -1, np.int32), "store")
    self.store_tick = Cell(np.zeros(shape, np.int64), "store tick")
    self.load = Cell(np.full(shape, -1, np.int32), "read")
    self.load_tick = Cell(np.zeros(shape, np.int64), "read tick")


class DeviceRaces:
  """The vector clocks and access records of one multi-device launch."""

  def __init__(self, kernel: str):
    self.kernel = kernel
    self.threads: list = []
    self.released: dict = {}     # semaphore or barrier -> its clock
    self.shadows: dict = {}      # id(cell) -> (cell, device, _Shadow)
    self.sites: list = []        # (thread, eqn)
    self.site_ids: dict = {}

  # -------------------------------------------------------- clocks

  def enter(self, thread) -> None:
    thread.tid = len(self.threads)
    thread.clock = {thread.tid: 1}
    self.threads.append(thread)

  def release(self, thread, sync) -> None:
    """`thread` signals or arrives on `sync`."""
    if thread.clock is None:
      return
    _join(self.released.setdefault(sync, {}), thread.clock)
    thread.clock[thread.tid] += 1

  def acquire(self, thread, sync) -> None:
    """`thread` has waited for what was signalled on `sync`."""
    if thread.clock is not None:
      _join(thread.clock, self.released.get(sync, {}))

  # -------------------------------------------------------- accesses

  def _site(self, thread, eqn) -> int:
    key = (thread.name, id(eqn))
    if key not in self.site_ids:
      self.site_ids[key] = len(self.sites)
      self.sites.append((thread, eqn))
    return self.site_ids[key]

  def _describe(self, site: int) -> str:
    thread, eqn = self.sites[site]
    line = where(eqn)
    return f"{thread.name} at {line}" if line else thread.name

  def access(self, cell: Cell, device: int, transforms, writes: bool):
    """Checks and records an access of `cell` (the copy on `device`) by
    the warpgroup running now."""
    thread, eqn = getattr(running, "thread", None), getattr(running, "eqn",
                                                            None)
    if thread is None or thread.clock is None:
      return
    entry = self.shadows.get(id(cell))
    if entry is None:
      entry = self.shadows[id(cell)] = (cell, device,
                                        _Shadow(cell.array.shape))
    shadow = entry[2]
    verb = "stores into" if writes else "reads"
    self._check(thread, eqn, shadow.store, shadow.store_tick, transforms,
                cell, device, verb, "store")
    if writes:
      self._check(thread, eqn, shadow.load, shadow.load_tick, transforms,
                  cell, device, verb, "read")
    site, tick = self._site(thread, eqn), thread.clock[thread.tid]
    ids, ticks = ((shadow.store, shadow.store_tick) if writes
                  else (shadow.load, shadow.load_tick))
    shape = np.shape(read(ids, transforms))
    write(ids, transforms, np.full(shape, site, np.int32))
    write(ticks, transforms, np.full(shape, tick, np.int64))

  def _unordered(self, clock: dict, device: int, ids, ticks):
    """The sites (of other devices than `device`) among `ids` whose
    ticks `clock` has not seen."""
    ids, ticks = np.asarray(ids).reshape(-1), np.asarray(ticks).reshape(-1)
    for site in np.unique(ids[ids >= 0]):
      other = self.sites[site][0]
      if other.machine.device == device:
        continue
      if clock.get(other.tid, 0) < ticks[ids == site].max():
        return int(site)
    return None

  def _check(self, thread, eqn, ids_cell, ticks_cell, transforms, cell,
             device, verb, what):
    site = self._unordered(thread.clock, thread.machine.device,
                           read(ids_cell, transforms),
                           read(ticks_cell, transforms))
    if site is None:
      return
    raise KernelRaceError(
        self.kernel, f"race on {cell.label} of device {device}: "
        f"{thread.name} {verb} it, but the {what} of "
        f"{self._describe(site)} is not ordered before (signal a semaphore "
        "after it and wait for that signal first)", where(eqn))

  def finish(self) -> None:
    """Every peer's access of a device's memory is ordered before that
    device's kernel ends."""
    for cell, device, shadow in self.shadows.values():
      end: dict = {}
      for th in self.threads:
        if th.machine.device == device:
          _join(end, th.clock)
      for ids, ticks, verb in ((shadow.store, shadow.store_tick, "store"),
                               (shadow.load, shadow.load_tick, "read")):
        site = self._unordered(end, device, ids.array, ticks.array)
        if site is not None:
          thread, eqn = self.sites[site]
          raise KernelRaceError(
              self.kernel, f"race on {cell.label} of device {device}: the "
              f"kernel ends on device {device} before the {verb} of "
              f"{self._describe(site)} is ordered before its end (wait "
              "for a signal made after it): the memory may be reused "
              "while it is in flight", where(eqn))
