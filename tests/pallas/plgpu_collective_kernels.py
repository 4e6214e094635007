"""Kernels of one multi-device plgpu primitive each, written against
`(pl, plgpu)` so that dsl's and Pallas's modules build them from the same
source (tests/pallas/test_plgpu_collectives.py lowers them on both,
test_plgpu_collectives_interpret.py runs them on the interpret backend),
each inside `shard_map` over the 8 devices of a mesh along "x"."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def _kernel(plgpu, body, scratch=(), dtype=F32, **extra):
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), dtype),
                      scratch_types=scratch, **extra)


def multimem_store(pl, plgpu, **extra):
  def body(x_ref, o_ref):
    plgpu.multimem_store(x_ref[...], o_ref, "x")
  return _kernel(plgpu, body, **extra)


def multimem_store_scalar(pl, plgpu, **extra):
  """One thread stores (the library stores 32-bit integer scalars)."""
  def body(x_ref, o_ref):
    plgpu.multimem_store(x_ref[3], o_ref.at[3], "x")
  return _kernel(plgpu, body, dtype=jnp.int32, **extra)


def multimem_load_reduce(pl, plgpu, **extra):
  def body(x_ref, o_ref):
    o_ref[...] = plgpu.layout_cast(
        plgpu.multimem_load_reduce(x_ref, collective_axes="x",
                                   reduction_op="add"),
        plgpu.Layout.WG_STRIDED((128,), vec_size=1))
  return _kernel(plgpu, body, **extra)


def multimem_load_max(pl, plgpu, **extra):
  """A signed maximum (of int32: the library's `Smax`)."""
  def body(x_ref, o_ref):
    o_ref[...] = plgpu.layout_cast(
        plgpu.multimem_load_reduce(x_ref, collective_axes="x",
                                   reduction_op="max"),
        plgpu.Layout.WG_STRIDED((128,), vec_size=1))
  return _kernel(plgpu, body, dtype=jnp.int32, **extra)


def device_index(pl, plgpu, **extra):
  def body(x_ref, o_ref):
    o_ref[...] = x_ref[...] + lax.axis_index("x").astype(F32)
  return _kernel(plgpu, body, **extra)


def signal_and_wait(pl, plgpu, **extra):
  """A signal to the next device, through a global semaphore, and a wait
  for the previous one's that keeps the count."""
  def body(x_ref, o_ref):
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
    nxt = lax.rem(lax.axis_index("x") + 1, 8)
    pl.semaphore_signal(sem, device_id={"x": nxt})
    pl.semaphore_wait(sem, 1, decrement=False)
  return _kernel(plgpu, body, **extra)


def multicast_signal(pl, plgpu, **extra):
  def body(x_ref, o_ref, sem):
    plgpu.semaphore_signal_multicast(sem, collective_axes="x")
    pl.semaphore_wait(sem, 8, decrement=False)
  return _kernel(plgpu, body, scratch=(plgpu.SemaphoreType.REGULAR,),
                 grid=(2,), grid_names=("blocks",), **extra)


def remote_copy(pl, plgpu, **extra):
  """A TMA store into the next device's output."""
  def body(x_ref, o_ref):
    def scope(smem, barrier):
      plgpu.copy_gmem_to_smem(x_ref, smem, barrier)
      plgpu.barrier_wait(barrier)
      nxt = lax.rem(lax.axis_index("x") + 1, 8)
      plgpu.copy_smem_to_gmem(smem, plgpu.remote_ref(o_ref, {"x": nxt}))
      plgpu.wait_smem_to_gmem(0)
    pl.run_scoped(scope, plgpu.SMEM((128,), F32), plgpu.Barrier())
  return _kernel(plgpu, body, **extra)
