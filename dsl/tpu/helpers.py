"""TPU helpers built from the DSL's own primitives: a synchronous copy, masked
loads and stores, a reciprocal, and a remote copy that starts at once."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsl.core.primitives import run_scoped
from dsl.core import ref_ops
from dsl.core.semaphores import DeviceIdType, SemaphoreType
from dsl.tpu.primitives import make_async_copy, make_async_remote_copy


def sync_copy(src_ref, dst_ref, *, add: bool = False) -> None:
  """Copies a pytree of refs into another one and waits for it: every copy
  is a DMA on one scoped semaphore, all started, then all waited. With
  `add=True` each copy adds its source to its destination."""
  if not jax.tree.leaves(src_ref):
    return

  def copies(sem):
    descs = jax.tree.leaves(jax.tree.map(
        lambda s, d: make_async_copy(s, d, sem), src_ref, dst_ref),
        is_leaf=lambda x: hasattr(x, "wait"))
    for d in descs:
      d.start(add=add)
    for d in descs:
      d.wait()

  run_scoped(copies, SemaphoreType.DMA(()))


def load(ref, *, mask=None):
  """Reads the whole `ref` (a view with `.at[...]`); where `mask` is False
  the value is unspecified (poison on the host backends)."""
  return ref_ops.load(ref, mask=mask)


def store(ref, val, *, mask=None) -> None:
  """Writes `val` to `ref` where `mask` is True (everywhere without it)."""
  ref_ops.store(ref, val, mask=mask)


def reciprocal(x, *, approx: bool = False, full_range: bool = True):
  """1 / x. `approx` and `full_range` are hints: the result is exact."""
  del approx, full_range
  return jnp.reciprocal(x)


def async_remote_copy(src_ref, dst_ref, send_sem, recv_sem, device_id,
                      device_id_type=DeviceIdType.MESH):
  """Starts a remote DMA (`make_async_remote_copy(...).start()`) and returns
  its descriptor."""
  return make_async_remote_copy(src_ref, dst_ref, send_sem, recv_sem,
                                device_id, device_id_type).start()


def is_tpu_device() -> bool:
  """Whether JAX's default device is a TPU."""
  return jax.devices()[0].platform == "tpu"
