"""DMAs and semaphores: `tpu.enqueue_dma` / `tpu.wait_dma` (`wait_dma2`) and
`tpu.sem_signal` / `tpu.sem_wait`, local or to another device."""
from __future__ import annotations

from typing import Optional

from dsl.core.jax_internals import ir

from lowering_mosaic.verification.promela import model as M
from lowering_mosaic.verification.promela.model import Expr
from lowering_mosaic.verification.promela.mosaic_ir import handles, nbytes_of


def _device(x, env, v) -> Optional[Expr]:
  if v is None:
    return None
  d = x.int_value(env, v)
  if d is None:
    x.note("a remote device id is computed from values the model does not "
           "track; the model lets it be any device")
    return None
  return d


@handles("tpu.enqueue_dma")
def _enqueue_dma(x, op, env, out):
  src = x.view(env, op.source, op, "DMA source")
  dst = x.view(env, op.target, op, "DMA target")
  dst_sem = x.sem_ref(env, op.target_semaphore, op)
  src_sem = (x.sem_ref(env, op.source_semaphore, op)
             if op.source_semaphore is not None else None)
  remote = op.device_id is not None
  dev = _device(x, env, op.device_id) if remote else None
  sw, dw = src.window(), dst.window()
  src.base.windows.append(sw)
  dst.base.windows.append(dw)
  if remote:
    dst_sem.sem.remote_recv = True
  nbytes = nbytes_of(op.source.type)
  what = f"DMA {sw.describe()} -> {dw.describe()}"
  if remote:
    what += f" on device {M.show(dev)}"
  what += f", signals {dst_sem.describe()}"
  if src_sem is not None:
    what += f" and {src_sem.describe()}"
  out.append(M.DmaStart(sw, dw, src_sem, dst_sem, dev, remote, nbytes,
                        x.info(op, what)))


@handles("tpu.wait_dma2", "tpu.wait_dma")
def _wait_dma(x, op, env, out):
  """A DMA wait: `wait_dma2` names the semaphore awaited (jax 0.11's
  Pallas); `wait_dma` names the whole copy and, by `wait_target`, the end
  awaited: the target semaphore, or the source one (jax 0.12's)."""
  if op.operation.name == "tpu.wait_dma2":
    sem_value, src, dst = op.semaphore, op.src, op.dst
  else:
    src, dst = op.source, op.target
    wait_target = ir.BoolAttr(op.attributes["wait_target"]).value
    sem_value = op.target_semaphore if wait_target else op.source_semaphore
  sem = x.sem_ref(env, sem_value, op)
  nbytes = nbytes_of(dst.type)
  what = f"waits for DMA {x.view(env, src, op, 'src').window().describe()}"
  what += f" -> {x.view(env, dst, op, 'dst').window().describe()}"
  what += f" on {sem.describe()}"
  out.append(M.DmaWait(sem, nbytes, x.info(op, what)))


@handles("tpu.sem_signal")
def _sem_signal(x, op, env, out):
  sem = x.sem_ref(env, op.semaphore, op)
  amount = x.int_value(env, op.amount)
  remote = op.device_id is not None
  dev = _device(x, env, op.device_id) if remote else None
  what = f"signals {sem.describe()}"
  what += f" by {M.show(amount)}"
  if remote:
    what += f" on device {M.show(dev)}"
  out.append(M.Signal(sem, amount, dev, remote, x.info(op, what)))


@handles("tpu.sem_wait")
def _sem_wait(x, op, env, out):
  sem = x.sem_ref(env, op.semaphore, op)
  amount = x.int_value(env, op.amount)
  what = f"waits for {sem.describe()} >= {M.show(amount)}"
  out.append(M.SemWait(sem, amount, x.info(op, what)))
