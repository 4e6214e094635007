"""Simulated devices, DMA engines, semaphores and the dynamic race checker.

Every device runs the kernel (its whole grid) as a Python generator. The
scheduler (`World.run`) picks a runnable device at random (seeded) and runs
it until its next *scheduling point*: a DMA start, a DMA wait, a semaphore
signal or wait, or the end of a grid step. Between scheduling points a
device runs alone. At every scheduling round each in-flight DMA completes
with probability `dma_completion_prob`, so DMAs land in a random order; a
DMA lands by copying its source into its destination and adding its size in
bytes to its semaphores (the receive semaphore on the destination device,
and the send semaphore on the source device for remote copies).

Race checking works on happens-before, not on luck: a DMA's destination
window is *pending* from its start until a wait on its semaphore on the
receiving device has taken its bytes back, and its source window until the
wait on the send semaphore (local copies: the one wait covers both). Then:

- reading or writing a pending destination window is a race
  ("read while a DMA writes it");
- writing a pending source window is a race ("written while a DMA reads it");
- a DMA whose destination overlaps another pending destination is two
  writers; one whose source overlaps a pending destination reads data that
  is still arriving; one whose destination overlaps a pending source
  overwrites data still being read.

A wait that can never finish (every device blocked, no DMA in flight) is a
deadlock; a kernel that ends with DMAs not waited for or semaphores not back
to zero is reported too. Reports name the kernel's source lines.

A device is a chip of `InterpreterOptions.num_cores` TensorCores (1 by
default: a chip without megacore). Each core is a process of its own here
(a `Device`: its SMEM, VMEM, scratch, semaphores and grid share; run.py
splits the grid), and the cores of one chip share its HBM buffers. Device
ids in the kernel (`tpu.device_id`, remote DMAs and signals) name chips: a
remote DMA or signal lands on the core of the same index on the peer chip.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable

import numpy as np

from lowering_mosaic.verification.interpreter.buffers import (Buffer, MemRef,
                                                             boxes_overlap,
                                                             describe_box)


class KernelSimulationError(RuntimeError):
  """The simulated kernel did something a TPU would not survive."""

  def __init__(self, kind: str, message: str, lines=()):
    self.kind = kind
    self.lines = tuple(l for l in lines if l)
    super().__init__(message)


class KernelRaceError(KernelSimulationError):
  """A buffer was touched while a DMA into or out of it was in flight."""


class KernelDeadlockError(KernelSimulationError):
  """A semaphore or DMA wait can never finish."""


@dataclasses.dataclass(frozen=True)
class InterpreterOptions:
  """How `mosaic_interpret` simulates a kernel.

  seed: seeds the order in which devices run and DMAs land.
  dma_completion_prob: chance that an in-flight DMA lands at each
    scheduling round (lower = DMAs stay in flight longer).
  on_race: "raise" (default) raises KernelRaceError at the first race;
    "warn" records it (see `lowering_mosaic.verification.interpreter.reports()`) and
    warns, and the kernel goes on.
  check_semaphores_at_end: a kernel must end with every semaphore at zero
    and every DMA waited for, as Mosaic requires.
  max_steps: scheduling rounds before the simulation gives up (a spin
    loop on `semaphore_read` that never ends, for instance).
  poison_buffers: scratch and run_scoped buffers start as poison (NaN,
    see dsl/core/poison.py) instead of zeros; JAX's jax_pallas_poison_buffers.
  runtime_checks: a block index outside its array is an error (without
    it, such a block reads poison and its writes are dropped);
    jax_pallas_enable_runtime_assert.
  The last two follow JAX's options when a kernel is lowered.
  num_cores: the TensorCores of each simulated chip. 1 (default) is a chip
    without megacore, which runs the whole grid on one core; 2 models a
    megacore chip (TPU v4, v5p), which splits the leading "parallel" (or
    "core_parallel") grid dims between its cores, each with its own SMEM,
    VMEM, scratch and semaphores, as Pallas's
    `InterpretParams(num_cores_or_threads=2)` does.
  """
  seed: int = 0
  dma_completion_prob: float = 0.3
  on_race: str = "raise"
  check_semaphores_at_end: bool = True
  max_steps: int = 5_000_000
  poison_buffers: bool = False
  runtime_checks: bool = False
  num_cores: int = 1

  def __post_init__(self):
    n = self.num_cores
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ValueError(f"InterpreterOptions num_cores must be a positive "
                       f"int (the TensorCores of a chip), got {n!r}")


@dataclasses.dataclass
class Wait:
  """Yielded by a device that cannot go on until `ready()`."""
  ready: Callable[[], bool]
  what: str
  line: str | None


PREEMPT = object()   # yielded at scheduling points that do not block


@dataclasses.dataclass
class Dma:
  id: int
  src: MemRef
  dst: MemRef
  dst_sem: tuple        # (device, buffer key, index)
  src_sem: tuple | None
  nbytes: int
  line: str | None
  device: int           # the core that started it
  remote: bool = False  # between two chips
  landed: bool = False
  src_synced: bool = False
  dst_synced: bool = False


class Device:
  """One simulated TensorCore (the whole device on a chip of one core): its
  buffers by key (its chip's HBM buffers too) and allocation counters."""

  def __init__(self, index: int, chip: int = 0, core: int = 0):
    self.index = index        # chip * cores per chip + core
    self.chip = chip          # the device id the kernel sees
    self.core = core
    self.buffers: dict[Any, Buffer] = {}
    self.alloc_counts: dict[Any, int] = {}
    self.waiting: Wait | None = None
    self.done = False
    self.prng = None          # [key, key, draw counter] once seeded
    self.grid: tuple = ()     # the grid it runs (dynamic sizes filled in)

  def add(self, buf: Buffer) -> Buffer:
    self.buffers[buf.key] = buf
    return buf


class World:
  """All devices of one kernel launch, their DMAs and the scheduler."""

  def __init__(self, num_devices: int, options: InterpreterOptions,
               kernel: str = "kernel"):
    cores = options.num_cores
    self.num_chips = num_devices
    self.devices = [Device(chip * cores + core, chip, core)
                    for chip in range(num_devices) for core in range(cores)]
    self.options = options
    self.kernel = kernel
    self.rng = random.Random(options.seed)
    self.inflight: list[Dma] = []
    self.pending: list[Dma] = []     # landed or not, not yet fully waited
    self.next_dma = 0
    self.reports: list[KernelSimulationError] = []

  # ---------------------------------------------------------- reporting

  def report(self, err: KernelSimulationError):
    if isinstance(err, KernelRaceError) and self.options.on_race != "raise":
      import warnings
      self.reports.append(err)
      warnings.warn(str(err), RuntimeWarning, stacklevel=2)
      return
    raise err

  def where(self, device: int) -> str:
    """"device 1", "core 0", "device 1, core 0"; "" for one core of one
    device."""
    d = self.devices[device]
    parts = ([f"device {d.chip}"] if self.num_chips > 1 else []) + (
        [f"core {d.core}"] if self.options.num_cores > 1 else [])
    return ", ".join(parts)

  def _prefix(self, device: int) -> str:
    where = self.where(device)
    return f"kernel '{self.kernel}'" + (f" on {where}" if where else "")

  # ---------------------------------------------------------- buffers

  def peer(self, device: int, chip: int) -> int:
    """The core of `device`'s index on chip `chip` (a device id of the
    kernel's), which its remote DMAs and signals reach."""
    if not 0 <= chip < self.num_chips:
      raise KernelSimulationError(
          "device", f"{self._prefix(device)}: device id {chip} does "
          f"not exist ({self.num_chips} devices)")
    return chip * self.options.num_cores + self.devices[device].core

  def buffer_on(self, device: int, buf: Buffer) -> Buffer:
    """The buffer of `buf`'s allocation on another core."""
    if device == buf.device:
      return buf
    other = self.devices[device].buffers.get(buf.key)
    if other is None:
      raise KernelSimulationError(
          "device", f"{self._prefix(buf.device)}: {buf.name} has no "
          f"counterpart on {self.where(device)}")
    return other

  def view_on(self, device: int, ref: MemRef) -> MemRef:
    return MemRef(self.buffer_on(device, ref.buf), ref.base, ref.sizes,
                  ref.dims)

  # ---------------------------------------------------------- race checks

  def check_access(self, ref_buf: Buffer, box, write: bool, line,
                   what: str = None):
    if not self.pending:
      return
    for dma in self.pending:
      if not dma.dst_synced and dma.dst.buf is ref_buf and boxes_overlap(
          box, dma.dst.box):
        verb = "written" if write else "read"
        self.report(KernelRaceError(
            "race", f"{self._prefix(ref_buf.device)}: race on "
            f"{describe_box(ref_buf, box)}: {what or verb} at {line} while "
            f"the DMA started at {dma.line} is writing "
            f"{describe_box(dma.dst.buf, dma.dst.box)} (wait for it first: "
            f".wait() / .wait_recv())", (line, dma.line)))
      if write and not dma.src_synced and dma.src.buf is ref_buf and \
          boxes_overlap(box, dma.src.box):
        self.report(KernelRaceError(
            "race", f"{self._prefix(ref_buf.device)}: race on "
            f"{describe_box(ref_buf, box)}: {what or 'written'} at {line} "
            f"while the DMA started at {dma.line} is reading "
            f"{describe_box(dma.src.buf, dma.src.box)} (wait for it first: "
            f".wait() / .wait_send())", (line, dma.line)))

  def _check_new_dma(self, dma: Dma):
    for other in self.pending:
      if not other.dst_synced and other.dst.buf is dma.dst.buf and \
          boxes_overlap(dma.dst.box, other.dst.box):
        self.report(KernelRaceError(
            "race", f"{self._prefix(dma.device)}: two writers: the DMA "
            f"started at {dma.line} writes "
            f"{describe_box(dma.dst.buf, dma.dst.box)}, which the DMA "
            f"started at {other.line} is still writing",
            (dma.line, other.line)))
      if not other.dst_synced and other.dst.buf is dma.src.buf and \
          boxes_overlap(dma.src.box, other.dst.box):
        self.report(KernelRaceError(
            "race", f"{self._prefix(dma.device)}: race: the DMA started at "
            f"{dma.line} reads {describe_box(dma.src.buf, dma.src.box)} "
            f"while the DMA started at {other.line} is still writing it",
            (dma.line, other.line)))
      if not other.src_synced and other.src.buf is dma.dst.buf and \
          boxes_overlap(dma.dst.box, other.src.box):
        self.report(KernelRaceError(
            "race", f"{self._prefix(dma.device)}: race: the DMA started at "
            f"{dma.line} overwrites {describe_box(dma.dst.buf, dma.dst.box)}"
            f" while the DMA started at {other.line} is still reading it",
            (dma.line, other.line)))

  # ---------------------------------------------------------- semaphores

  def sem_cell(self, device: int, ref: MemRef):
    buf = self.buffer_on(device, ref.buf)
    return buf, tuple(ref.base)

  def sem_value(self, device: int, ref: MemRef) -> int:
    buf, idx = self.sem_cell(device, ref)
    return int(buf.array[idx])

  def sem_add(self, device: int, ref: MemRef, amount: int):
    buf, idx = self.sem_cell(device, ref)
    buf.array[idx] += amount

  # ---------------------------------------------------------- DMAs

  def start_dma(self, device: int, src: MemRef, dst: MemRef, dst_sem: MemRef,
                src_sem: MemRef | None, target: int | None, line):
    if src.shape != dst.shape or src.buf.array.dtype != dst.buf.array.dtype:
      raise KernelSimulationError(
          "dma", f"{self._prefix(device)}: DMA at {line} copies "
          f"{src.shape} {src.buf.array.dtype} into {dst.shape} "
          f"{dst.buf.array.dtype}", (line,))
    target = device if target is None else self.peer(device, int(target))
    dst_view = self.view_on(target, dst)
    nbytes = int(np.prod(src.shape, dtype=np.int64)) * src.buf.array.itemsize
    dst_cell = (target, dst_sem.buf.key, tuple(dst_sem.base))
    src_cell = (device, src_sem.buf.key, tuple(src_sem.base)) \
        if src_sem is not None else None
    dma = Dma(self.next_dma, src, dst_view, dst_cell, src_cell, nbytes, line,
              device, self.devices[target].chip != self.devices[device].chip)
    self.next_dma += 1
    self._check_new_dma(dma)
    self.inflight.append(dma)
    self.pending.append(dma)
    return dma

  def land(self, dma: Dma):
    """The DMA's data arrives and its semaphores go up."""
    dma.dst.write(np.array(dma.src.read(), copy=True))
    dma.landed = True
    self.inflight.remove(dma)
    dev, key, idx = dma.dst_sem
    self.devices[dev].buffers[key].array[idx] += dma.nbytes
    if dma.src_sem is not None:
      dev, key, idx = dma.src_sem
      self.devices[dev].buffers[key].array[idx] += dma.nbytes

  def progress(self):
    """Each in-flight DMA lands with probability dma_completion_prob."""
    p = self.options.dma_completion_prob
    for dma in list(self.inflight):
      if self.rng.random() < p:
        self.land(dma)

  def waited(self, device: int, sem: MemRef, nbytes: int, view: MemRef):
    """A wait on `sem` took `nbytes` back: marks the DMAs it covers."""
    key, idx = sem.buf.key, tuple(sem.base)
    cell = (device, key, idx)
    cands = [d for d in self.pending if d.landed and (
        (d.dst_sem == cell and not d.dst_synced) or
        (d.src_sem == cell and not d.src_synced))]
    # prefer the DMA whose window the wait names
    def matches(d):
      side = d.dst if d.dst_sem == cell else d.src
      return side.buf.key == view.buf.key and side.box == view.box
    cands.sort(key=lambda d: (not matches(d), d.id))
    left = nbytes
    for d in cands:
      if left <= 0:
        break
      if d.dst_sem == cell and not d.dst_synced:
        d.dst_synced = True
        if not d.remote:
          d.src_synced = True
      elif d.src_sem == cell:
        d.src_synced = True
      left -= d.nbytes
    self.pending = [d for d in self.pending
                    if not (d.src_synced and d.dst_synced)]

  # ---------------------------------------------------------- scheduling

  def run(self, programs):
    """Runs one generator per device to the end (see the module doc)."""
    gens = list(programs)
    steps = 0
    while True:
      alive = [d for d in self.devices if not d.done]
      if not alive:
        break
      steps += 1
      if steps > self.options.max_steps:
        raise KernelSimulationError(
            "bound", f"kernel '{self.kernel}': gave up after "
            f"{self.options.max_steps} scheduling rounds (a wait loop that "
            "never ends?)")
      if self.inflight:
        self.progress()
      runnable = [d for d in alive if d.waiting is None or d.waiting.ready()]
      if not runnable:
        if self.inflight:
          self.land(self.rng.choice(self.inflight))
          continue
        self._deadlock(alive)
      dev = self.rng.choice(runnable)
      dev.waiting = None
      try:
        req = next(gens[dev.index])
      except StopIteration:
        dev.done = True
        continue
      if isinstance(req, Wait):
        dev.waiting = req
    self._check_end()

  def _deadlock(self, alive):
    lines, parts = [], []
    for d in alive:
      w = d.waiting
      parts.append(f"{self.where(d.index)} waits at {w.line} for {w.what}"
                   if len(self.devices) > 1 else
                   f"the wait at {w.line} for {w.what}")
      lines.append(w.line)
    raise KernelDeadlockError(
        "deadlock", f"kernel '{self.kernel}': a wait can never finish (no "
        "DMA in flight and no device left to signal): " + "; ".join(parts),
        lines)

  def _check_end(self):
    if not self.options.check_semaphores_at_end:
      return
    if self.pending:
      d = self.pending[0]
      side = "its destination" if not d.dst_synced else "its source"
      raise KernelSimulationError(
          "semaphore", f"{self._prefix(d.device)}: the kernel ended but the "
          f"DMA started at {d.line} was never waited for ({side}; call "
          ".wait())", (d.line,))
    for dev in self.devices:
      for buf in dev.buffers.values():
        if buf.space == "semaphore_mem" and np.any(buf.array != 0):
          idx = tuple(int(i) for i in np.argwhere(buf.array != 0)[0])
          raise KernelSimulationError(
              "semaphore", f"{self._prefix(dev.index)}: the kernel ended "
              f"with semaphore {buf.name}{list(idx) if idx else ''} at "
              f"{int(buf.array[idx])}; every signal needs a matching wait")
