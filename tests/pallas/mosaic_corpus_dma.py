"""Golden corpus: DMAs, semaphores and kernels inside shard_map (see
mosaic_corpus.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tests.pallas.mosaic_corpus import api, case, f32, sds


# ------------------------------------------------------------ DMAs and semaphores

@case
def dma_slices_with_grid(pl, pltpu):
  def chunk_kernel(x_hbm, o_ref, buf, sems):
    i = pl.program_id(0)
    copies = [pltpu.make_async_copy(x_hbm.at[pl.ds(i * 16 + 8 * k, 8)],
                                    buf.at[k], sems.at[k]) for k in range(2)]
    for c in copies:
      c.start()
    for c in copies:
      c.wait()
    o_ref[...] = buf[0] + buf[1]
  f = pl.pallas_call(
      chunk_kernel, sds((32, 128)), grid=(2,),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
      scratch_shapes=[pltpu.VMEM((2, 8, 128), jnp.float32),
                      pltpu.SemaphoreType.DMA((2,))])
  return f, (f32(32, 128),)


@case
def dma_to_any_output(pl, pltpu):
  def writeback_kernel(x_ref, o_hbm, sem):
    c = pltpu.make_async_copy(x_ref, o_hbm.at[pl.ds(8, 8)], sem)
    c.start()
    c.wait()
  f = pl.pallas_call(
      writeback_kernel, sds((16, 128)),
      in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
      out_specs=pl.BlockSpec(memory_space=pl.ANY),
      scratch_shapes=[pltpu.SemaphoreType.DMA])
  return f, (f32(8, 128),)


@case
def regular_semaphores(pl, pltpu):
  def sem_kernel(x_ref, o_ref, sem):
    api(pl, pltpu, 'semaphore_signal')(sem, 2)
    api(pl, pltpu, 'semaphore_wait')(sem, 2)
    o_ref[...] = x_ref[...] + api(pl, pltpu, 'semaphore_read')(sem).astype(jnp.float32)
  f = pl.pallas_call(sem_kernel, sds((8, 128)),
                     scratch_shapes=[pltpu.SemaphoreType.REGULAR])
  return f, (f32(8, 128),)


N_DEV = 4


def _mesh():
  from jax.sharding import Mesh
  return Mesh(np.array(jax.devices()[:N_DEV]), ("x",))


def _shard(pl, call):
  from jax.sharding import PartitionSpec as P
  return jax.shard_map(call, mesh=_mesh(), in_specs=P("x"), out_specs=P("x"),
                       check_vma=False)


@case
def remote_ring_copy(pl, pltpu):
  def ring_kernel(x_ref, o_ref, send_sem, recv_sem):
    me = lax.axis_index("x")
    right = lax.rem(me + 1, N_DEV)
    c = pltpu.make_async_remote_copy(x_ref, o_ref, send_sem, recv_sem,
                                     device_id=(right,),
                                     device_id_type=api(pl, pltpu, 'DeviceIdType').MESH)
    c.start()
    c.wait()
  call = pl.pallas_call(
      ring_kernel, sds((8, 128)),
      in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
      out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
      scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA])
  return _shard(pl, call), (f32(N_DEV * 8, 128),)


@case
def remote_wait_send_recv(pl, pltpu):
  def split_wait_kernel(x_ref, o_ref, send_sem, recv_sem):
    me = lax.axis_index("x")
    left = lax.rem(me + N_DEV - 1, N_DEV)
    c = pltpu.make_async_remote_copy(x_ref, o_ref, send_sem, recv_sem,
                                     device_id=(left,),
                                     device_id_type=api(pl, pltpu, 'DeviceIdType').MESH)
    c.start()
    c.wait_send()
    c.wait_recv()
  call = pl.pallas_call(
      split_wait_kernel, sds((8, 128)),
      in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
      out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
      scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA])
  return _shard(pl, call), (f32(N_DEV * 8, 128),)


@case
def barrier_and_remote_signal(pl, pltpu):
  def barrier_kernel(x_ref, o_ref):
    me = lax.axis_index("x")
    barrier = pltpu.get_barrier_semaphore()
    api(pl, pltpu, 'semaphore_signal')(barrier, 1, device_id=(lax.rem(me + 1, N_DEV),),
                           device_id_type=api(pl, pltpu, 'DeviceIdType').MESH)
    api(pl, pltpu, 'semaphore_wait')(barrier, 1)
    o_ref[...] = x_ref[...] + me.astype(jnp.float32)
  call = pl.pallas_call(
      barrier_kernel, sds((8, 128)),
      in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
      out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
      compiler_params=pltpu.CompilerParams(collective_id=0))
  return _shard(pl, call), (f32(N_DEV * 8, 128),)


@case
def barrier_in_control_flow(pl, pltpu):
  def barrier_loop_kernel(x_ref, o_ref):
    me = lax.axis_index("x")
    barrier = pltpu.get_barrier_semaphore()
    mesh = api(pl, pltpu, 'DeviceIdType').MESH

    def signal_peer(k, carry):
      api(pl, pltpu, 'semaphore_signal')(
          barrier, 1, device_id=(lax.rem(me + 1 + k, N_DEV),),
          device_id_type=mesh)
      return carry
    lax.fori_loop(0, 2, signal_peer, 0)

    @pl.when(me < N_DEV)
    def _():
      api(pl, pltpu, 'semaphore_wait')(barrier, 2)
    o_ref[...] = x_ref[...]
  call = pl.pallas_call(
      barrier_loop_kernel, sds((8, 128)),
      in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
      out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
      compiler_params=pltpu.CompilerParams(collective_id=0))
  return _shard(pl, call), (f32(N_DEV * 8, 128),)


@case
def barrier_with_tag(pl, pltpu):
  # the tag, not CompilerParams(collective_id=...), names the collective
  def tagged_barrier_kernel(x_ref, o_ref):
    me = lax.axis_index("x")
    barrier = pltpu.get_barrier_semaphore(tag=("ring", 1))
    api(pl, pltpu, 'semaphore_signal')(
        barrier, 1, device_id=(lax.rem(me + 1, N_DEV),),
        device_id_type=api(pl, pltpu, 'DeviceIdType').MESH)
    api(pl, pltpu, 'semaphore_wait')(barrier, 1)
    o_ref[...] = x_ref[...] * 2.0
  call = pl.pallas_call(
      tagged_barrier_kernel, sds((8, 128)),
      in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
      out_specs=pl.BlockSpec(memory_space=pltpu.VMEM))
  return _shard(pl, call), (f32(N_DEV * 8, 128),)


@case
def logical_device_id(pl, pltpu):
  def logical_kernel(x_ref, o_ref, send_sem, recv_sem):
    c = pltpu.make_async_remote_copy(x_ref, o_ref, send_sem, recv_sem,
                                     device_id=0,
                                     device_id_type=api(pl, pltpu, 'DeviceIdType').LOGICAL)
    c.start()
    c.wait()
  call = pl.pallas_call(
      logical_kernel, sds((8, 128)),
      in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
      out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
      scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA])
  return _shard(pl, call), (f32(N_DEV * 8, 128),)


# ------------------------------------------------------------ accumulating DMAs
# Both lowerings reject these (test_mosaic_golden.REJECTED_BY_BOTH).

@case
def accumulating_dma(pl, pltpu):
  def accumulate_kernel(x_hbm, o_ref, sem):
    o_ref[...] = jnp.ones_like(o_ref)
    pltpu.make_async_copy(x_hbm, o_ref, sem).start(add=True)
    pltpu.make_async_copy(x_hbm, o_ref, sem).wait()
  f = pl.pallas_call(
      accumulate_kernel, sds((8, 128)),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      scratch_shapes=[pltpu.SemaphoreType.DMA])
  return f, (f32(8, 128),)


@case
def accumulating_sync_copy(pl, pltpu):
  def sync_accumulate_kernel(x_hbm, o_ref):
    o_ref[...] = jnp.ones_like(o_ref)
    pltpu.sync_copy(x_hbm, o_ref, add=True)
  f = pl.pallas_call(
      sync_accumulate_kernel, sds((8, 128)),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)])
  return f, (f32(8, 128),)


@case
def accumulating_remote_copy(pl, pltpu):
  def remote_accumulate_kernel(x_ref, o_ref, send_sem, recv_sem):
    right = lax.rem(lax.axis_index("x") + 1, N_DEV)
    c = pltpu.make_async_remote_copy(x_ref, o_ref, send_sem, recv_sem,
                                     device_id=(right,),
                                     device_id_type=api(pl, pltpu, 'DeviceIdType').MESH)
    c.start(add=True)
    c.wait()
  call = pl.pallas_call(
      remote_accumulate_kernel, sds((8, 128)),
      in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
      out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
      scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA])
  return _shard(pl, call), (f32(N_DEV * 8, 128),)
