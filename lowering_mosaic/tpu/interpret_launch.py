"""Backend "mosaic_interpret": the Mosaic module run on the host by our
interpreter (lowering_mosaic.verification.interpreter) through
`jax.pure_callback`. Partitioned by a sharded `jax.jit`, each device
simulates its own part alone. Inside `shard_map`, every operand is
all-gathered over the mesh, one callback simulates every device of the
launch (the devices' callbacks share that one simulation), and each device
keeps its own slice of the outputs (dsl.core.device_launch).
"""
from __future__ import annotations

import hashlib
import re

import jax
import numpy as np
from dsl.core.jax_internals import mlir

from dsl.core import checks, device_launch, host_failures
from dsl.core.errors import (BackendError, KernelCheckError,
                             KernelDeadlockError, KernelError, KernelRaceError,
                             KernelRuntimeError)
from lowering_mosaic.tpu.mlir_modules import dump_module
from dsl.core.device_launch import mesh_axes_from_context, num_devices
from lowering_mosaic.tpu.lowering import build_module_and_context, module_text
from lowering_mosaic.verification import interpreter as interp
from lowering_mosaic.verification import promela
from lowering_mosaic.verification.interpreter.run import (cached_program,
                                                          simulate)


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
  n = num_devices(mesh_axes)
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
    def run(per_device):
      return _run(key, text, per_device, layout, options, spec.name)
    fn = device_launch.on_every_device(run, spec, mesh_axes, axis_context,
                                       (key, options))

  return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)

