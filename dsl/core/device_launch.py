"""One host run of every device of a launch inside `shard_map`: how the
host backends that simulate several devices together (`mosaic_interpret`'s
MLIR interpreter, the interpret backend's warpgroup interpreter for
`plgpu.kernel`s that talk to other devices) run a kernel.

Each operand is all-gathered over the shard_map's mesh; the devices'
host callbacks share one run of the simulation of every device (the first
callback of a launch runs it, the others wait for its result), and each
device keeps its own slice of the outputs. A failure of the run reaches
every device's callback, and so every device (dsl.core.host_failures).
Partitioned by a sharded `jax.jit` instead, each device runs its part
alone (`spec.local`).
"""
from __future__ import annotations

import hashlib
import math
import threading
from typing import Callable, Sequence

import jax
import numpy as np
from jax import lax

from dsl.core import host_failures
from dsl.core.errors import BackendError
from dsl.core.inspection import mesh_axes_of
from dsl.core.jax_internals import core, sharding_impls


def num_devices(mesh_axes) -> int:
  return math.prod(s for _, s in mesh_axes) if mesh_axes else 1


def mesh_axes_from_context(ctx, spec, on_host: bool = False) -> tuple:
  """((axis, size), ...) of the shard_map mesh the kernel runs in, or ().

  Under a sharded `jax.jit` (no shard_map) a kernel partitions itself
  (dsl/transforms/partitioning.py) and each device runs its part alone
  (`spec.local`).
  """
  ac = ctx.module_context.axis_context
  if spec.local:     # partitioned under a sharded jit: one device, its shards
    return ()
  if isinstance(ac, sharding_impls.SPMDAxisContext):
    manual = set(ac.manual_axes)
    return tuple((n, s) for n, s in mesh_axes_of(ac.mesh)
                 if not manual or n in manual)
  if (isinstance(ac, sharding_impls.ShardingContext) and ac.num_devices > 1
      and not on_host):
    raise BackendError(spec.name, "a Mosaic kernel cannot be partitioned "
                       "automatically over several devices; call it inside "
                       "jax.shard_map", spec.where)
  return ()


def digest(arrays) -> str:
  """A hash of the contents of `arrays` (with their shapes and dtypes)."""
  h = hashlib.sha1()
  for a in arrays:
    a = np.ascontiguousarray(a)
    h.update(str((a.shape, a.dtype.str)).encode())
    h.update(a.tobytes())
  return h.hexdigest()


class _SharedLaunch:
  """The one run that the n device callbacks of a launch share."""

  def __init__(self, n):
    self.event = threading.Event()
    self.remaining = n
    self.result = None
    self.error = None


_SHARED: dict = {}
_SHARED_LOCK = threading.Lock()


def shared_run(key, gathered: Sequence[np.ndarray], n: int,
               run: Callable[[list[list[np.ndarray]]], list]) -> list:
  """`run(per_device)` (per device, its operands; returns per device, its
  outputs), run once for the n callbacks of one launch: those that call
  with the same `key` and the same gathered operands share it."""
  launch_key = (key, digest(gathered))
  with _SHARED_LOCK:
    entry = _SHARED.get(launch_key)
    owner = entry is None
    if owner:
      entry = _SHARED[launch_key] = _SharedLaunch(n)
  if owner:
    try:
      entry.result = run([[g[d] for g in gathered] for d in range(n)])
    except BaseException as e:    # every device's callback reports it
      entry.error = e
    finally:
      entry.event.set()
  else:
    entry.event.wait()
  with _SHARED_LOCK:
    entry.remaining -= 1
    if entry.remaining <= 0:
      _SHARED.pop(launch_key, None)
  if entry.error is not None:
    raise entry.error
  return entry.result


def on_every_device(run, spec, mesh_axes, axis_context, key) -> Callable:
  """A function of one device's (traced) operands, inside the shard_map of
  `mesh_axes`, that runs `run(per_device)` once for every device of the
  launch in a host callback (`shared_run`) and returns this device's
  outputs. `key` names the kernel (with what else decides its run)."""
  out_avals = spec.grid_mapping.out_avals
  n = num_devices(mesh_axes)
  names = tuple(nm for nm, _ in mesh_axes)
  axis = names if len(names) > 1 else names[0]

  def host(*gathered):
    gathered = [np.asarray(g) for g in gathered]
    outs = shared_run(key, gathered, n, run)
    return [np.stack([np.asarray(outs[d][k], a.dtype) for d in range(n)])
            for k, a in enumerate(out_avals)]

  def fn(*xs):
    with core.extend_axis_env_nd(list(mesh_axes)):
      gathered = [lax.all_gather(x, axis, tiled=False).reshape(
          (n,) + tuple(x.shape)) for x in xs]
      outs, failed = host_failures.call_host(
          host, [jax.ShapeDtypeStruct((n,) + tuple(a.shape), a.dtype)
                 for a in out_avals], *gathered, kernel=spec.name,
          source=spec.kernel_src)
      me = lax.axis_index(axis)
      outs = [o[me] for o in outs]
    host_failures.raise_parked(axis_context, failed)
    return outs
  return fn
