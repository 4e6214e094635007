"""Device ids in a `plgpu.kernel` that runs inside `shard_map`: this
device's index along an axis of the device mesh (`lax.axis_index` of a
mesh axis) and the logical id of a `device_id` (a peer of
`pl.semaphore_signal(device_id=...)` or `plgpu.remote_ref`).

The device id is read from the collective metadata jaxlib's Mosaic GPU
library passes every kernel that communicates (`LaunchContext.device_id`:
the rank, row-major over the mesh, as Pallas's lowering reads it).
"""
from __future__ import annotations

import numpy as np

from dsl.core.jax_internals import arith, ir
from dsl.core.semaphores import DeviceIdType
from lowering_mosaic.gpu.host import i32


def in_mesh_kernel(ctx, what: str) -> None:
  """`what` lowers in `plgpu.kernel`s, whose warpgroups issue it."""
  if ctx.host.lane_predicate is None:
    raise ctx.error(f"{what} lowers in plgpu.kernels only (a pallas_call "
                    "on backend 'mosaic_gpu' has no device mesh nor "
                    "semaphores in global memory)")


def device_mesh(ctx, what: str):
  """The device mesh of the shard_map the kernel runs in."""
  in_mesh_kernel(ctx, what)
  mesh = ctx.host.jax_mesh
  if mesh is None:
    raise ctx.error(f"{what} needs the kernel to run inside jax.shard_map "
                    "over a mesh of GPUs (no device mesh is known)")
  return mesh


def as_i32(v) -> ir.Value:
  """`v` (an int, an index or i32 value) as an i32 value."""
  if isinstance(v, ir.Value):
    if isinstance(v.type, ir.IndexType):
      return arith.index_cast(ir.IntegerType.get_signless(32), v)
    return v
  return i32(int(v))


def device_index(ctx, axis_name) -> ir.Value:
  """This device's index along `axis_name` of the device mesh (i32)."""
  mesh = device_mesh(ctx, f"lax.axis_index({axis_name!r})")
  names = tuple(mesh.axis_names)
  shape = tuple(int(mesh.shape[n]) for n in names)
  k = names.index(axis_name)
  device = ctx.host.launch_ctx.device_id()
  size = i32(shape[k])
  minor = i32(int(np.prod(shape[k + 1:], dtype=np.int64)))
  return arith.remsi(arith.divsi(device, minor), size)


def logical_device(ctx, values, device_id_type, axes=None) -> ir.Value:
  """The logical id (row-major over the device mesh, i32) of a device_id:
  one int (LOGICAL), or mesh coordinates, all of them or those of `axes`
  (a dict's; the others are this device's)."""
  values = [as_i32(v) for v in values]
  if device_id_type == DeviceIdType.LOGICAL:
    return values[0]
  mesh = device_mesh(ctx, "a device_id")
  names = tuple(mesh.axis_names)
  if axes is None:
    if len(values) != len(names):
      raise ctx.error(f"device_id has {len(values)} coordinates but the "
                      f"device mesh has axes {names}")
    axes = names
  given = dict(zip(axes, values))
  coords = [given[n] if n in given else device_index(ctx, n) for n in names]
  lin = None
  for k, c in enumerate(coords):
    stride = int(np.prod([mesh.shape[m] for m in names[k + 1:]],
                         dtype=np.int64))
    term = arith.muli(c, i32(stride))
    lin = arith.addi(i32(0) if lin is None else lin, term)
  return lin


def peer_device(ctx, peer) -> ir.Value:
  """The logical id of the device of a `plgpu.remote_ref` (its
  `PeerMemRef` transform, whose device id is operands now)."""
  ids = peer.device_id
  if isinstance(ids, dict):
    return logical_device(ctx, list(ids.values()), peer.device_id_type,
                          tuple(ids))
  return logical_device(ctx, [ids], peer.device_id_type)
