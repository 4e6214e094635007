"""Operands in HBM, as the kernels that reverse mode derives see them.

The transposed and recording kernels read and write their operands whole
(`ref[...]`). A kernel cannot load or store a ref in HBM (`pl.ANY`,
`tpu.HBM`) on Mosaic, so these kernels copy such operands into VMEM buffers
with DMAs, work on the buffers, and copy the ones they write back, on the
backends that copy `emit_pipeline`'s blocks (Mosaic and interpret; Triton
and Mosaic GPU address HBM directly and have no DMAs). The whole
operand is then held in VMEM at once: on a TPU that bounds the size of the
arrays these derived kernels can take.
"""
from __future__ import annotations

from dsl.core.memory import MemorySpace
from dsl.core.primitives import run_scoped
from dsl.core.semaphores import SemaphoreType, is_semaphore_aval
from dsl.tpu.pipeline_blocks import backend_copies_blocks
from dsl.tpu.primitives import make_async_copy


def in_hbm(aval) -> bool:
  return getattr(aval, "memory_space", None) in (MemorySpace.ANY,
                                                 MemorySpace.HBM)


def is_semaphore(aval) -> bool:
  return is_semaphore_aval(aval)


def with_vmem_copies(refs, reads, writes, fn):
  """`fn(*refs)`, where each ref in HBM is replaced by a VMEM buffer that
  is first filled from it (where `reads`) and copied back to it after
  `fn` (where `writes`)."""
  staged = [k for k, r in enumerate(refs) if in_hbm(r.aval)]
  if not staged or not backend_copies_blocks():
    return fn(*refs)
  types = [MemorySpace.VMEM(refs[k].shape, refs[k].dtype) for k in staged]

  def body(*bufs_sem):
    *bufs, sem = bufs_sem
    local = list(refs)
    for k, buf in zip(staged, bufs):
      if reads[k]:
        make_async_copy(refs[k], buf, sem).start().wait()
      local[k] = buf
    fn(*local)
    for k, buf in zip(staged, bufs):
      if writes[k]:
        make_async_copy(buf, refs[k], sem).start().wait()

  run_scoped(body, *types, SemaphoreType.DMA(()))
