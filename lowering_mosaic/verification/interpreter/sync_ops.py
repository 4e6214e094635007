"""The Mosaic interpreter's DMA and semaphore operations: `tpu.enqueue_dma`,
the DMA waits (`tpu.wait_dma`, as jax 0.12's Pallas emits them, and
`tpu.wait_dma2`, as 0.11's), `tpu.sem_signal`, `tpu.sem_wait` and
`tpu.sem_read`, run against the devices of `simulator.World`.

Each entry of `SYNC_OPS` is `rule(op, compiler) -> (fn, operands, is
generator)`, as in program.py's table of stateful operations.
"""
from __future__ import annotations

import numpy as np
from dsl.core.jax_internals import ir

from dsl.core.jaxpr_walk import RuleTable
from lowering_mosaic.verification.interpreter.buffers import MemRef
from lowering_mosaic.verification.interpreter.simulator import (
    PREEMPT, KernelSimulationError, Wait)

SYNC_OPS = RuleTable("the Mosaic interpreter")
sync_op = SYNC_OPS.register


def _opt(v):
  return v is not None


@sync_op("tpu.enqueue_dma")
def _enqueue_dma(op, c):
  v = op.opview
  args = [v.source, v.target, v.target_semaphore]
  has_src_sem, has_dev = _opt(v.source_semaphore), _opt(v.device_id)
  if has_src_sem:
    args.append(v.source_semaphore)
  if has_dev:
    args.append(v.device_id)

  def fn(frame, src, dst, dst_sem, *rest):
    rest = list(rest)
    src_sem = rest.pop(0) if has_src_sem else None
    target = int(rest.pop(0)) if has_dev else None
    frame.world.start_dma(frame.device, src, dst, dst_sem, src_sem, target,
                          frame.line)
    yield PREEMPT
  return fn, args, True


def _nbytes(ref: MemRef) -> int:
  return int(np.prod(ref.shape, dtype=np.int64)) * ref.buf.array.itemsize


def _sem_desc(world, device, sem: MemRef):
  idx = list(sem.base)
  return (f"{sem.buf.name}{idx if idx else ''} (now "
          f"{world.sem_value(device, sem)})")


def _await(frame, sem: MemRef, amount: int, view: MemRef):
  """Waits until `sem` holds `amount` bytes of DMAs and takes them back;
  `view` is the local window of the copy awaited."""
  world, dev = frame.world, frame.device

  def ready():
    return world.sem_value(dev, sem) >= amount
  yield Wait(ready, f"a DMA of {amount} bytes on semaphore "
             f"{_sem_desc(world, dev, sem)}", frame.line)
  world.sem_add(dev, sem, -amount)
  world.waited(dev, sem, amount, view)


@sync_op("tpu.wait_dma")
def _wait_dma(op, c):
  """The wait names the whole copy; `wait_target` says which end: the
  target semaphore and window (the receiver's), or the source ones (the
  sender's, once its source has been read)."""
  v = op.opview
  if ir.BoolAttr(op.attributes["wait_target"]).value:
    args = [v.target_semaphore, v.target]
  elif v.source_semaphore is not None:
    args = [v.source_semaphore, v.source]
  else:
    raise KernelSimulationError(
        "unsupported", "the Mosaic interpreter cannot wait for the source "
        "of a DMA without a source semaphore", ())

  def fn(frame, sem, view):
    yield from _await(frame, sem, _nbytes(view), view)
  return fn, args, True


@sync_op("tpu.wait_dma2")
def _wait_dma2(op, c):
  v = op.opview
  args = [v.semaphore, v.src, v.dst]
  # a send's wait names the copy's ends swapped (Pallas's form, with a
  # core_id): its local source window is the `dst` operand
  swapped = v.core_id is not None

  def fn(frame, sem, src, dst):
    world, dev = frame.world, frame.device
    # the side of the copy this device waits for: the local window named
    # by the wait (dst for the receiver, src for the sender)
    is_send = any(d.src_sem == (dev, sem.buf.key, tuple(sem.base))
                  for d in world.pending) and not any(
                      d.dst_sem == (dev, sem.buf.key, tuple(sem.base))
                      for d in world.pending)
    view = (dst if swapped else src) if is_send else dst
    yield from _await(frame, sem, _nbytes(dst), view)
  return fn, args, True


@sync_op("tpu.sem_signal")
def _sem_signal(op, c):
  v = op.opview
  has_dev = _opt(v.device_id)
  args = [v.semaphore, v.amount] + ([v.device_id] if has_dev else [])

  def fn(frame, sem, amount, *dev):
    target = (frame.world.peer(frame.device, int(dev[0])) if dev
              else frame.device)
    frame.world.sem_add(target, sem, int(amount))
    yield PREEMPT
  return fn, args, True


@sync_op("tpu.sem_wait")
def _sem_wait(op, c):
  v = op.opview
  args = [v.semaphore, v.amount]

  def fn(frame, sem, amount):
    world, dev = frame.world, frame.device
    amount = int(amount)

    def ready():
      return world.sem_value(dev, sem) >= amount
    yield Wait(ready, f"semaphore {_sem_desc(world, dev, sem)} to reach "
               f"{amount}", frame.line)
    world.sem_add(dev, sem, -amount)
  return fn, args, True


@sync_op("tpu.sem_read")
def _sem_read(op, c):
  def fn(frame, sem):
    yield PREEMPT
    return np.int32(frame.world.sem_value(frame.device, sem))
  return fn, list(op.operands), True
