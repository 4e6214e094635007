"""The multi-device names of `plgpu`: refs on a peer device, NVSHMEM
multicast stores, loads that reduce over devices, and semaphore signals to
every device. The kernels that use them run inside `shard_map` over GPUs
whose memory is symmetric (NVSHMEM).

- `remote_ref(ref, device_id)`: `ref` as it lies on device `device_id` (a
  `PeerMemRef` transform); copies and stores through it write the peer's
  memory.
- `multimem_store(value, ref, collective_axes)`: stores `value` into `ref`
  on every device along `collective_axes`.
- `multimem_load_reduce(ref, collective_axes=, reduction_op=)`: `ref` read
  on every device along `collective_axes`, reduced ("add", "min", "max",
  "and", "or", "xor").
- `semaphore_signal_multicast(sem, value, collective_axes=)`: adds `value`
  to `sem` on every device along `collective_axes`.

They are primitives with abstract evals, so kernels that use them trace;
backend "mosaic_gpu" lowers them as Pallas does (docs/mosaic-gpu.md,
"Collectives"); the interpret backend runs every device's warpgroups
together inside `shard_map` (dsl/interpret/devices.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Hashable

import jax.numpy as jnp
from jax import tree_util
from jax.extend.core import Primitive

from dsl.core.errors import KernelTypeError, user_frame
from dsl.core.jax_internals import core, state_types
from dsl.core.operand_layout import pack
from dsl.core.semaphores import DeviceIdType, is_semaphore_aval
from dsl.mosaic_gpu.primitives import gpu_effect, ref_effects, ref_parts


def _axes(collective_axes) -> tuple[Hashable, ...]:
  if isinstance(collective_axes, (tuple, list)):
    return tuple(collective_axes)
  return (collective_axes,)


@tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PeerMemRef(state_types.Transform):
  """A ref transform: the same ref on device `device_id`."""
  device_id: Any
  device_id_type: DeviceIdType = dataclasses.field(
      default=DeviceIdType.MESH, metadata=dict(static=True))

  def transform_type(self, x):
    return x

  def transform_shape(self, shape):
    return shape

  def transform_dtype(self, dtype):
    return dtype

  def undo(self, x):
    raise NotImplementedError("a peer ref has no inverse")


def remote_ref(ref, device_id, device_id_type: DeviceIdType | None = None):
  """`ref` on device `device_id` (an int, or a dict of mesh coordinates)."""
  base, transforms = ref_parts("ref", ref)
  peer = PeerMemRef(device_id if isinstance(device_id, dict)
                    else jnp.asarray(device_id, jnp.int32),
                    device_id_type or DeviceIdType.MESH)
  return state_types.TransformedRef(base, (*transforms, peer))


multimem_store_p = Primitive("multimem_store")
multimem_store_p.multiple_results = True


@multimem_store_p.def_effectful_abstract_eval
def _multimem_store_abstract_eval(*avals, layout, collective_axes):
  return [], ref_effects(layout, writes=("ref",))


def multimem_store(source, ref, collective_axes) -> None:
  """Stores `source` into `ref` on every device along `collective_axes`."""
  base, transforms = ref_parts("ref", ref)
  flat, layout = pack(source=jnp.asarray(source), ref=base,
                      ref_t=transforms)
  multimem_store_p.bind(*flat, layout=layout,
                        collective_axes=_axes(collective_axes))


multimem_load_reduce_p = Primitive("multimem_load_reduce")


@multimem_load_reduce_p.def_effectful_abstract_eval
def _multimem_load_reduce_abstract_eval(*avals, layout, shape,
                                        collective_axes, reduction_op):
  return (core.ShapedArray(shape, avals[0].dtype),
          ref_effects(layout, reads=("ref",)))


def multimem_load_reduce(ref, *, collective_axes, reduction_op):
  """`ref` read on every device along `collective_axes`, reduced with
  `reduction_op`."""
  base, transforms = ref_parts("ref", ref)
  shape = (tuple(state_types.TransformedRef(base, transforms).shape)
           if transforms else tuple(core.typeof(base).shape))
  flat, layout = pack(ref=base, ref_t=transforms)
  return multimem_load_reduce_p.bind(
      *flat, layout=layout, shape=shape,
      collective_axes=_axes(collective_axes),
      reduction_op=str(getattr(reduction_op, "value", reduction_op)))


semaphore_signal_multicast_p = Primitive("semaphore_signal_multicast")
semaphore_signal_multicast_p.multiple_results = True


@semaphore_signal_multicast_p.def_effectful_abstract_eval
def _signal_multicast_abstract_eval(*avals, layout, collective_axes):
  return [], ref_effects(layout, reads=("sem",), writes=("sem",)) | {
      gpu_effect}


def semaphore_signal_multicast(semaphore, value=1, *, collective_axes):
  """Adds `value` to `semaphore` on every device along `collective_axes`."""
  base, transforms = ref_parts("semaphore", semaphore)
  if not is_semaphore_aval(core.typeof(base)):
    raise KernelTypeError(None, "semaphore_signal_multicast takes a "
                          "semaphore (plgpu.SemaphoreType.REGULAR)",
                          user_frame(), operand="semaphore")
  flat, layout = pack(sem=base, sem_t=transforms,
                      value=jnp.asarray(value, jnp.int32))
  semaphore_signal_multicast_p.bind(*flat, layout=layout,
                                    collective_axes=_axes(collective_axes))
