"""The verification corpus: DMA/semaphore kernels, correct and broken.

Each case is a kernel written with `dsl` (as a user would, for TPUs),
lowered to its Mosaic module and checked by SPIN through
`lowering_mosaic.verify`; the correct ones verify `ok` and each broken
variant is reported with the kind of its bug (test_promela_cases.py);
`scripts/promela_corpus.py` prints docs/verification.md's table of them.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import dsl as pl
from dsl import tpu as pltpu

ROWS, LANES = 8, 128
CHUNK = (ROWS, LANES)


def _bind(kernel, **params):
  """functools.partial that keeps the kernel's name and source line."""
  return functools.update_wrapper(functools.partial(kernel, **params), kernel)


# ------------------------------------------------------------ one device

def _copy_kernel(x_hbm, o_ref, buf, sem, *, variant="ok"):
  """HBM -> VMEM scratch by DMA, then compute into the output block."""
  copy = pltpu.make_async_copy(x_hbm, buf, sem.at[0])
  copy.start()
  if variant == "read_early":
    o_ref[...] = buf[...] * 2.0          # BUG: reads buf while the DMA lands
    copy.wait()
    return
  if variant == "wrong_sem":
    pltpu.make_async_copy(x_hbm, buf, sem.at[1]).wait()   # BUG: not sem[0]
  else:
    copy.wait()
  o_ref[...] = buf[...] * 2.0


def copy_through_vmem(variant="ok"):
  def f(x):
    return pl.pallas_call(
        _bind(_copy_kernel, variant=variant),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(CHUNK, lambda: (0, 0)),
        scratch_shapes=[pltpu.VMEM(CHUNK, jnp.float32),
                        pltpu.SemaphoreType.DMA((2,))],
        backend="mosaic")(x)
  return f, (jax.ShapeDtypeStruct(CHUNK, jnp.float32),)


def _writeback_kernel(x_hbm, o_hbm, buf, sem, *, variant="ok"):
  """HBM -> VMEM, compute in place, VMEM -> HBM output, all by DMA."""
  load = pltpu.make_async_copy(x_hbm, buf, sem.at[0])
  load.start()
  load.wait()
  buf[...] = buf[...] + 1.0
  store = pltpu.make_async_copy(buf, o_hbm, sem.at[1])
  store.start()
  if variant != "missing_wait":
    store.wait()                         # BUG when missing: never waited


def copy_writeback(variant="ok"):
  def f(x):
    return pl.pallas_call(
        _bind(_writeback_kernel, variant=variant),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.VMEM(CHUNK, jnp.float32),
                        pltpu.SemaphoreType.DMA((2,))],
        backend="mosaic")(x)
  return f, (jax.ShapeDtypeStruct(CHUNK, jnp.float32),)


def _double_buffer_kernel(x_hbm, o_ref, bufs, sems, *, n, variant="ok"):
  """A loop over n HBM chunks, fetching chunk i+1 while chunk i is used."""
  def fetch(i, slot):
    return pltpu.make_async_copy(x_hbm.at[i], bufs.at[slot], sems.at[slot])

  fetch(0, 0).start()

  def body(i, carry):
    slot = lax.rem(i, 2)
    nxt = 1 - slot if variant != "same_slot" else slot   # BUG: same slot

    @pl.when(i + 1 < n)
    def _():
      fetch(i + 1, nxt).start()

    fetch(i, slot).wait()
    o_ref[i] = bufs[slot] + 1.0
    return carry

  lax.fori_loop(0, n, body, 0)


def double_buffered(variant="ok", n=3):
  def f(x):
    return pl.pallas_call(
        _bind(_double_buffer_kernel, n=n, variant=variant),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((n,) + CHUNK, lambda: (0, 0, 0)),
        scratch_shapes=[pltpu.VMEM((2,) + CHUNK, jnp.float32),
                        pltpu.SemaphoreType.DMA((2,))],
        backend="mosaic")(x)
  return f, (jax.ShapeDtypeStruct((n,) + CHUNK, jnp.float32),)


def _parallel_kernel(x_hbm, o_hbm, buf, sems, *, variant="ok"):
  """Each parallel grid point (a process of its own) brings its chunk into
  VMEM, works on it and writes it back to HBM by DMA."""
  i = pl.program_id(0)
  load = pltpu.make_async_copy(x_hbm.at[i], buf, sems.at[0])
  load.start()
  load.wait()
  buf[...] = buf[...] * 2.0
  dst = o_hbm.at[i] if variant == "ok" else o_hbm.at[0]   # BUG: same chunk
  store = pltpu.make_async_copy(buf, dst, sems.at[1])
  store.start()
  store.wait()


def parallel_grid(variant="ok", n=2):
  def f(x):
    return pl.pallas_call(
        _bind(_parallel_kernel, variant=variant),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(n,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.VMEM(CHUNK, jnp.float32),
                        pltpu.SemaphoreType.DMA((2,))],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",)),
        backend="mosaic")(x)
  return f, (jax.ShapeDtypeStruct((n,) + CHUNK, jnp.float32),)


def _grid_prefetch_kernel(x_hbm, o_ref, bufs, sems, *, n, variant="ok"):
  """Manual pipelining across an 'arbitrary' grid: step i waits for chunk i
  (started by step i-1) and starts chunk i+1 into the other slot. The
  broken variant DMAs straight into the pipelined output block and defers
  the wait to the next step, across the pipeline's copy-out."""
  i = pl.program_id(0)
  slot = lax.rem(i, 2)

  def fetch(j, s):
    if variant == "into_block":
      return pltpu.make_async_copy(x_hbm.at[j], o_ref, sems.at[s])
    return pltpu.make_async_copy(x_hbm.at[j], bufs.at[s], sems.at[s])

  if variant == "into_block":
    @pl.when(i > 0)
    def _():
      fetch(i - 1, 1 - slot).wait()     # BUG: last step's DMA into its block
    fetch(i, slot).start()

    @pl.when(i == n - 1)
    def _():
      fetch(i, slot).wait()
    return

  @pl.when(i == 0)
  def _():
    fetch(0, 0).start()

  @pl.when(i + 1 < n)
  def _():
    fetch(i + 1, 1 - slot).start()

  fetch(i, slot).wait()
  o_ref[...] = bufs[slot] + 1.0


def grid_prefetch(variant="ok", n=3):
  def f(x):
    return pl.pallas_call(
        _bind(_grid_prefetch_kernel, n=n, variant=variant),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(n,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((None,) + CHUNK, lambda i: (i, 0, 0)),
        scratch_shapes=[pltpu.VMEM((2,) + CHUNK, jnp.float32),
                        pltpu.SemaphoreType.DMA((2,))],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",)),
        backend="mosaic")(x)
  return f, (jax.ShapeDtypeStruct((n,) + CHUNK, jnp.float32),)


def _scoped_kernel(x_hbm, o_ref, *, variant="ok"):
  """run_scoped VMEM buffer and DMA semaphore."""
  def body(buf, sem):
    c = pltpu.make_async_copy(x_hbm, buf, sem)
    c.start()
    if variant == "ok":
      c.wait()
      o_ref[...] = buf[...]
  pl.run_scoped(body, pltpu.VMEM(CHUNK, jnp.float32), pltpu.SemaphoreType.DMA)


def scoped(variant="ok"):
  def f(x):
    return pl.pallas_call(
        _bind(_scoped_kernel, variant=variant),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(CHUNK, lambda: (0, 0)),
        backend="mosaic")(x)
  return f, (jax.ShapeDtypeStruct(CHUNK, jnp.float32),)


# ------------------------------------------------------------ collectives

def _mesh(n):
  return Mesh(np.array(jax.devices()[:n]), ("x",))


def _handshake(me, n, extra_signal=False):
  """Every device tells both ring neighbours it has entered the kernel."""
  barrier = pltpu.get_barrier_semaphore()
  left = lax.rem(me + n - 1, n)
  right = lax.rem(me + 1, n)
  pltpu.semaphore_signal(barrier, 1, device_id=(left,))
  pltpu.semaphore_signal(barrier, 1, device_id=(right,))
  if extra_signal:
    pltpu.semaphore_signal(barrier, 1, device_id=(right,))   # BUG: one more
  pltpu.semaphore_wait(barrier, 2)


def _all_gather_kernel(x_ref, o_ref, stage, send_sem, recv_sems, *, n,
                       variant="ok"):
  """Ring all-gather: at step k send chunk (me - k) to the right neighbour
  through a VMEM staging buffer. Step k's copy signals receive semaphore k:
  DMAs may land out of order, so a fast left neighbour's next copy must not
  satisfy this step's wait (variant "shared_recv" shares one semaphore)."""
  me = lax.axis_index("x")
  right = lax.rem(me + 1, n)
  if variant != "no_handshake":          # BUG when skipped: see below
    _handshake(me, n, extra_signal=variant == "unbalanced")
  o_ref[me] = x_ref[...]
  prev = None
  for k in range(n - 1):
    chunk = lax.rem(me - k + n, n)
    if variant == "overwrite" and prev is not None:
      stage[...] = o_ref[chunk]          # BUG: prev copy may still read stage
      prev.wait_send()
    else:
      stage[...] = o_ref[chunk]
    recv = recv_sems.at[0 if variant == "shared_recv" else k]
    copy = pltpu.make_async_remote_copy(stage, o_ref.at[chunk], send_sem,
                                        recv, device_id=(right,))
    copy.start()
    if variant == "overwrite":
      copy.wait_recv()
      prev = copy
    elif variant == "leave_early" and k == n - 2:
      copy.wait_send()                   # BUG: the last receive not waited
    else:
      copy.wait()
  if variant == "overwrite":
    prev.wait_send()


def ring_all_gather(variant="ok", n=4):
  def per_device(x):
    return pl.pallas_call(
        _bind(_all_gather_kernel, n=n, variant=variant),
        out_shape=jax.ShapeDtypeStruct((n,) + CHUNK, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.VMEM(CHUNK, jnp.float32),
                        pltpu.SemaphoreType.DMA,
                        pltpu.SemaphoreType.DMA((n - 1,))],
        compiler_params=pltpu.CompilerParams(collective_id=0),
        backend="mosaic")(x)
  f = jax.shard_map(per_device, mesh=_mesh(n), in_specs=P("x"),
                    out_specs=P("x"), check_vma=False)
  return f, (jax.ShapeDtypeStruct((n * ROWS, LANES), jnp.float32),)


def _reduce_scatter_kernel(x_ref, o_ref, acc, send_sem, recv_sems, *, n,
                           variant="ok"):
  """Ring reduce-scatter: the partial sum of chunk c travels the ring,
  each device adding its own part; step k lands in slot k of `acc` and
  signals receive semaphore k."""
  me = lax.axis_index("x")
  right = lax.rem(me + 1, n)
  _handshake(me, n)
  for k in range(n - 1):
    src = x_ref.at[lax.rem(me + n - 1, n)] if k == 0 else acc.at[k - 1]
    copy = pltpu.make_async_remote_copy(src, acc.at[k], send_sem,
                                        recv_sems.at[k], device_id=(right,))
    copy.start()
    copy.wait()
    c = lax.rem(me + 2 * n - k - 2, n)
    acc[k] = acc[k] + x_ref[c]
  o_ref[...] = acc[n - 2]


def ring_reduce_scatter(variant="ok", n=4):
  def per_device(x):
    return pl.pallas_call(
        _bind(_reduce_scatter_kernel, n=n, variant=variant),
        out_shape=jax.ShapeDtypeStruct(CHUNK, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.VMEM((n - 1,) + CHUNK, jnp.float32),
                        pltpu.SemaphoreType.DMA,
                        pltpu.SemaphoreType.DMA((n - 1,))],
        compiler_params=pltpu.CompilerParams(collective_id=0),
        backend="mosaic")(x)
  f = jax.shard_map(per_device, mesh=_mesh(n), in_specs=P("x"),
                    out_specs=P("x"), check_vma=False)
  return f, (jax.ShapeDtypeStruct((n * n, ROWS, LANES), jnp.float32),)


# ------------------------------------------------------------ the corpus

@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  build: Callable
  expected: str
  devices: int = 1
  bug: str = ""


CORPUS = [
    Case("copy through VMEM", copy_through_vmem, "ok"),
    Case("copy in and write back by DMA", copy_writeback, "ok"),
    Case("double-buffered loop (3 chunks)", double_buffered, "ok"),
    Case("parallel grid (2 points)", parallel_grid, "ok"),
    Case("prefetch across grid steps", grid_prefetch, "ok"),
    Case("run_scoped buffer and semaphore", scoped, "ok"),
    Case("ring all-gather, 2 devices",
         functools.partial(ring_all_gather, n=2), "ok", 2),
    Case("ring all-gather, 3 devices",
         functools.partial(ring_all_gather, n=3), "ok", 3),
    Case("ring all-gather, 4 devices",
         functools.partial(ring_all_gather, n=4), "ok", 4),
    Case("ring reduce-scatter, 2 devices",
         functools.partial(ring_reduce_scatter, n=2), "ok", 2),
    Case("ring reduce-scatter, 3 devices",
         functools.partial(ring_reduce_scatter, n=3), "ok", 3),
    Case("ring reduce-scatter, 4 devices",
         functools.partial(ring_reduce_scatter, n=4), "ok", 4),
    Case("missing wait", functools.partial(copy_writeback, "missing_wait"),
         "semaphore", bug="the write-back DMA is never waited for"),
    Case("wait on the wrong semaphore",
         functools.partial(copy_through_vmem, "wrong_sem"), "deadlock",
         bug="waits on sem[1]; the DMA signals sem[0]"),
    Case("buffer read before its DMA finished",
         functools.partial(copy_through_vmem, "read_early"), "race",
         bug="reads the VMEM buffer before waiting"),
    Case("double buffer refilled while in use",
         functools.partial(double_buffered, "same_slot"), "race",
         bug="prefetches chunk i+1 into the slot chunk i is read from"),
    Case("DMA into a pipelined block across a grid step",
         functools.partial(grid_prefetch, "into_block"), "race",
         bug="waits for the DMA into its output block one step later"),
    Case("scoped buffer freed with a DMA in flight",
         functools.partial(scoped, "no_wait"), "race",
         bug="leaves run_scoped without waiting for the DMA into it"),
    Case("parallel grid points write one HBM chunk",
         functools.partial(parallel_grid, "shared"), "race",
         bug="both grid points DMA their result into chunk 0"),
    Case("buffer overwritten while a remote copy reads it",
         functools.partial(ring_all_gather, "overwrite", n=3), "race", 3,
         bug="restages the send buffer before the last send finished"),
    Case("unbalanced signal/wait",
         functools.partial(ring_all_gather, "unbalanced", n=2), "semaphore", 2,
         bug="signals the right neighbour's barrier twice"),
    Case("one receive semaphore for all ring steps",
         functools.partial(ring_all_gather, "shared_recv", n=3), "race", 3,
         bug="a fast neighbour's next copy satisfies this step's wait"),
    Case("remote copy before the peer entered the kernel",
         functools.partial(ring_all_gather, "no_handshake", n=2), "race", 2,
         bug="no barrier handshake: the copy may land in a device that has "
         "not entered the kernel yet"),
    Case("device leaves while a peer writes into it",
         functools.partial(ring_all_gather, "leave_early", n=3), "race", 3,
         bug="skips waiting for its last receive"),
]
