"""Backend "mosaic_interpret": the Mosaic module run on the host by our
interpreter (lowering_mosaic.verification.interpreter) through
`jax.pure_callback`. Partitioned by a sharded `jax.jit`, each device
simulates its own part alone. Inside `shard_map`, every operand is
all-gathered over the mesh, one callback simulates every device of the
launch (the devices' callbacks share that one simulation), and each device
keeps its own slice of the outputs.
"""
from __future__ import annotations

import hashlib
import math
import re
import threading

import jax
import numpy as np
from jax import lax
from dsl.core.jax_internals import core, mlir

from dsl.core import checks, host_failures
from dsl.core.errors import (BackendError, KernelCheckError,
                             KernelDeadlockError, KernelError, KernelRaceError,
                             KernelRuntimeError)
from lowering_mosaic.tpu.mlir_modules import dump_module
from lowering_mosaic.tpu.launch import mesh_axes_from_context, num_devices
from lowering_mosaic.tpu.lowering import build_module_and_context, module_text
from lowering_mosaic.verification import interpreter as interp
from lowering_mosaic.verification import promela
from lowering_mosaic.verification.interpreter.run import (cached_program,
                                                          simulate)


class _SharedLaunch:
  """The one simulation that the n device callbacks of a launch share."""

  def __init__(self, n):
    self.event = threading.Event()
    self.remaining = n
    self.result = None
    self.error = None


_SHARED: dict = {}
_SHARED_LOCK = threading.Lock()


def _digest(arrays) -> str:
  h = hashlib.sha1()
  for a in arrays:
    a = np.ascontiguousarray(a)
    h.update(str((a.shape, a.dtype.str)).encode())
    h.update(a.tobytes())
  return h.hexdigest()


# What the simulator found -> the error the user gets.
_ERROR_KINDS = {"check": KernelCheckError, "deadlock": KernelDeadlockError,
                "race": KernelRaceError, "unsupported": BackendError}
_PREFIX = re.compile(
    r"^kernel '[^']*'(?: on ((?:device \d+)?(?:, )?(?:core \d+)?))?: ", re.S)


def kernel_error(e: interp.KernelSimulationError, kernel: str) -> KernelError:
  """The KernelError (first line: kernel, message, user line) for a failure
  of the simulated kernel."""
  text = str(e)
  m = _PREFIX.match(text)
  message, device = (text[m.end():], m.group(1)) if m else (text, None)
  where = e.lines[0] if e.lines else None
  if e.kind == "check":
    message, at = checks.split_check_text(message)
    where = at or where
  cls = _ERROR_KINDS.get(e.kind, KernelRuntimeError)
  return cls(kernel, message, where, operand=device)


def operand_dtypes(spec) -> list:
  """The dtype of every kernel operand (prefetch, inputs, outputs, scratch;
  None for semaphores), for the interpreter's poison."""
  gm = spec.grid_mapping
  avals = ([a.inner_aval for a in gm.prefetch_avals]
           + [bm.array_aval for bm in gm.block_mappings]
           + [getattr(a, "inner_aval", a) for a in gm.scratch_avals])
  out = []
  for a in avals:
    try:
      out.append(np.dtype(a.dtype))
    except TypeError:        # a semaphore
      out.append(None)
  return out


def _run(key, text, per_device, layout, options, kernel):
  """`layout`: (the outputs' shapes, every operand's dtype)."""
  shapes, dtypes = layout
  prog = cached_program(key, text)
  try:
    outs, world = simulate(prog, per_device, shapes, options, dtypes)
  except interp.KernelSimulationError as e:
    interp.note_failure(e)
    raise kernel_error(e, kernel) from e
  interp.note_reports(world.reports)
  return outs


def _shared_run(key, text, gathered, n, layout, options, kernel):
  launch_key = (key, _digest(gathered), options)
  with _SHARED_LOCK:
    entry = _SHARED.get(launch_key)
    owner = entry is None
    if owner:
      entry = _SHARED[launch_key] = _SharedLaunch(n)
  if owner:
    try:
      per_device = [[g[d] for g in gathered] for d in range(n)]
      entry.result = _run(key, text, per_device, layout, options, kernel)
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


def interpret_lowering(ctx, *args, spec):
  mesh_axes = mesh_axes_from_context(ctx, spec, on_host=True)
  module, _ = build_module_and_context(spec, mesh_axes)
  dump_module(spec, module)
  promela.maybe_dump(module, spec.name, num_devices=num_devices(mesh_axes))
  text = module_text(module, debug_info=True)
  key = hashlib.sha1(text.encode()).hexdigest()
  options = interp.current_options()
  out_avals = spec.grid_mapping.out_avals
  layout = ([tuple(a.shape) for a in out_avals], operand_dtypes(spec))
  n = math.prod(s for _, s in mesh_axes) if mesh_axes else 1
  axis_context = ctx.module_context.axis_context

  if n == 1:
    def host(*arrays):
      outs = _run(key, text, [[np.asarray(a) for a in arrays]], layout,
                  options, spec.name)
      return [np.asarray(o, a.dtype) for o, a in zip(outs[0], out_avals)]

    def fn(*xs):
      outs, failed = host_failures.call_host(
          host, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals],
          *xs, kernel=spec.name, source=spec.kernel_src)
      host_failures.raise_parked(axis_context, failed)
      return outs
  else:
    names = tuple(nm for nm, _ in mesh_axes)
    axis = names if len(names) > 1 else names[0]

    def host(*gathered):
      gathered = [np.asarray(g) for g in gathered]
      outs = _shared_run(key, text, gathered, n, layout, options,
                         spec.name)
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

  return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)

