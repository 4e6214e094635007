"""Collectives inside `shard_map`, written with remote DMAs and semaphores.

`all_gather(x, axis_name=...)` and `reduce_scatter(x, axis_name=...)` pass
chunks around the ring of devices on `axis_name` (the Mosaic path: run them
with `backend="mosaic_interpret"` on CPU, `"mosaic"` on TPU; the plain
`"interpret"` backend runs them too). Each ring step has its own receive
semaphore: DMAs complete in any order, so a fast neighbour's next copy must
not satisfy this step's wait (SPIN finds that race in a shared-semaphore
version; see docs/verification.md). Their gradients are each other.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import dsl as pl
from dsl import tpu as pltpu


def reference_all_gather(x, *, axis_name):
  return jax.lax.all_gather(x, axis_name, tiled=True)


def reference_reduce_scatter(x, *, axis_name):
  return jax.lax.psum_scatter(x, axis_name, tiled=True)


def _barrier(me, n):
  """Both ring neighbours have entered the kernel before any remote copy."""
  barrier = pltpu.get_barrier_semaphore()
  pltpu.semaphore_signal(barrier, 1, device_id=((me + 1) % n,))
  pltpu.semaphore_signal(barrier, 1, device_id=((me - 1) % n,))
  pltpu.semaphore_wait(barrier, 2)


def _all_gather_kernel(x_ref, o_ref, send_sem, recv_sems, *, axis_name, n,
                       rows):
  me = jax.lax.axis_index(axis_name)
  right = (me + 1) % n
  _barrier(me, n)
  o_ref[pl.ds(me * rows, rows)] = x_ref[...]
  for step in range(n - 1):
    chunk = (me - step) % n          # received last step (or my own)
    copy = pltpu.make_async_remote_copy(
        o_ref.at[pl.ds(chunk * rows, rows)], o_ref.at[pl.ds(chunk * rows, rows)],
        send_sem, recv_sems.at[step], device_id=(right,),
        device_id_type=pltpu.DeviceIdType.MESH)
    copy.start()
    copy.wait()


def _reduce_scatter_kernel(x_ref, o_ref, acc, recv, send_sem, recv_sems,
                           credit, *, axis_name, n, rows):
  """Partial sums travel right; the receiver double-buffers them and gives
  its left neighbour a credit once a slot is drained."""
  me = jax.lax.axis_index(axis_name)
  right, left = (me + 1) % n, (me - 1) % n
  _barrier(me, n)
  acc[...] = x_ref[...].astype(acc.dtype)
  for step in range(n - 1):
    slot = step % 2
    if step >= 2:
      pltpu.semaphore_wait(credit, 1)       # the right neighbour drained it
    send_chunk = (me - step - 1) % n
    copy = pltpu.make_async_remote_copy(
        acc.at[pl.ds(send_chunk * rows, rows)], recv.at[slot], send_sem,
        recv_sems.at[step], device_id=(right,),
        device_id_type=pltpu.DeviceIdType.MESH)
    copy.start()
    copy.wait()
    got = (me - step - 2) % n
    acc[pl.ds(got * rows, rows)] += recv[slot]
    if step + 2 <= n - 2:
      pltpu.semaphore_signal(credit, 1, device_id=(left,))
  o_ref[...] = acc[pl.ds(me * rows, rows)].astype(o_ref.dtype)


def _whole(shape):
  return pl.BlockSpec(shape, lambda: (0,) * len(shape))


def _all_gather_call(x, axis_name, backend):
  n = jax.lax.axis_size(axis_name)
  rows = x.shape[0]
  out_shape = (n * rows,) + x.shape[1:]
  if n == 1:
    return x
  kernel = functools.partial(_all_gather_kernel, axis_name=axis_name, n=n,
                             rows=rows)
  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct(out_shape, x.dtype),
      in_specs=[_whole(x.shape)], out_specs=_whole(out_shape),
      scratch_shapes=[pltpu.SemaphoreType.DMA,
                      pltpu.SemaphoreType.DMA((n - 1,))],
      compiler_params=pltpu.CompilerParams(collective_id=0),
      name="all_gather", backend=backend)(x)


def _reduce_scatter_call(x, axis_name, backend):
  n = jax.lax.axis_size(axis_name)
  if x.shape[0] % n:
    raise ValueError(f"reduce_scatter: dim 0 ({x.shape[0]}) must be a "
                     f"multiple of the axis size {n}")
  rows = x.shape[0] // n
  if n == 1:
    return x
  acc_dtype = jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
  kernel = functools.partial(_reduce_scatter_kernel, axis_name=axis_name, n=n,
                             rows=rows)
  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((rows,) + x.shape[1:], x.dtype),
      in_specs=[_whole(x.shape)], out_specs=_whole((rows,) + x.shape[1:]),
      scratch_shapes=[pltpu.VMEM(x.shape, acc_dtype),
                      pltpu.VMEM((2, rows) + x.shape[1:], acc_dtype),
                      pltpu.SemaphoreType.DMA,
                      pltpu.SemaphoreType.DMA((n - 1,)),
                      pltpu.SemaphoreType.REGULAR],
      compiler_params=pltpu.CompilerParams(collective_id=0),
      name="reduce_scatter", backend=backend)(x)


def _with_dual_vjp(call, dual):
  """`call` differentiable with `dual` as its transpose (they are linear)."""
  @functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
  def f(x, axis_name, backend):
    return call(x, axis_name, backend)

  f.defvjp(lambda x, axis_name, backend: (call(x, axis_name, backend), None),
           lambda axis_name, backend, _, g: (dual(g, axis_name, backend),))
  return f


_all_gather = _with_dual_vjp(_all_gather_call, _reduce_scatter_call)
_reduce_scatter = _with_dual_vjp(_reduce_scatter_call, _all_gather_call)


def all_gather(x, *, axis_name, backend=None):
  """Inside `shard_map`: every device's `x`, concatenated along dim 0."""
  return _all_gather(x, axis_name, backend)


def reduce_scatter(x, *, axis_name, backend=None):
  """Inside `shard_map`: chunk `axis_index` (dim 0 split in axis-size parts)
  of the sum of `x` over the devices."""
  return _reduce_scatter(x, axis_name, backend)


reference = reference_all_gather
