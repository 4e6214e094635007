"""The pallas_call lowering rule of the interpret backend: the kernel runs
as plain JAX ops (`execute.run`), with its run-time checks and waits made
values first where it has any (dsl.transforms.runtime_checks); inside
`dsl.profile`, as its own program in a host callback. A `plgpu.kernel`
runs its warpgroups together in a host callback (`warpgroups.run_kernel`);
one that talks to other devices inside `shard_map`, with every device's
warpgroups (`warpgroups.run_devices`, dsl.core.device_launch)."""
from __future__ import annotations

import functools

import jax
import numpy as np
from dsl.core.jax_internals import config as jax_config, mlir

from dsl.core import config, device_launch, host_failures
from dsl.tools import profiling
from dsl.interpret import warpgroups
from dsl.interpret.execute import run
from dsl.transforms import runtime_checks
from dsl.transforms.window_checks import has_run_time_windows


def interpret_lowering(ctx, *args, spec):
  """The pallas_call lowering rule of backend "interpret"."""
  if warpgroups.mesh_of(spec) is not None:
    # A plgpu.kernel: its warpgroups run together, on the host; one that
    # talks to other devices, with every device of its shard_map.
    warpgroups.check_runnable(spec)
    axis_context = ctx.module_context.axis_context
    device_axes = (device_launch.mesh_axes_from_context(ctx, spec, True)
                   if warpgroups.talks_to_devices(spec) else ())
    if device_axes:
      fn = device_launch.on_every_device(
          functools.partial(warpgroups.run_devices, spec, device_axes),
          spec, device_axes, axis_context,
          ("plgpu.kernel", id(spec), config.poison_buffers()))
    else:
      fn = _in_callback(functools.partial(warpgroups.run_kernel, spec), spec,
                        axis_context)
    with jax_config._check_vma(False):
      return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
  warpgroups.check_single_programs(spec)
  fn = functools.partial(run, spec=spec)
  # With runtime asserts on, block indices read from data and windows
  # placed at run time are checked too.
  asserts = config.enable_runtime_assert()
  check_blocks = asserts and bool(runtime_checks.data_dependent_blocks(spec))
  check_windows = asserts and has_run_time_windows(spec.jaxpr.jaxpr)
  if ((check_blocks or check_windows
       or runtime_checks.needs_checks(spec.jaxpr.jaxpr))
      and not runtime_checks.is_checked(spec)):
    # Run-time checks and waits become values; a failure raises from the host.
    axis_context = ctx.module_context.axis_context

    def fn(*xs):
      return runtime_checks.run_checked(spec, run, xs, axis_context,
                                        check_blocks, check_windows)
  if profiling.enabled():
    fn = _on_host(fn, spec, ctx.module_context.axis_context)
  # Inside shard_map the operands vary over manual axes; the interpreter's
  # own zeros and iotas do not, and the kernel is per-device anyway.
  with jax_config._check_vma(False):
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def _in_callback(run, spec, axis_context):
  """A function of the kernel's (traced) operands that calls `run(*arrays)`
  (numpy in, the outputs out) in a host callback; a KernelError it raises
  reaches the caller (dsl.core.host_failures)."""
  shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype)
            for a in spec.grid_mapping.out_avals]

  def fn(*xs):
    outs, failed = host_failures.call_host(run, shapes, *xs,
                                           kernel=spec.name,
                                           source=spec.kernel_src)
    host_failures.raise_parked(axis_context, failed)
    return outs
  return fn


def _on_host(fn, spec, axis_context):
  """`fn` compiled on its own and run in a host callback (`dsl.profile`):
  timed and named in traces, not fused with its neighbours."""

  def on_host(*xs):
    # Compiled ahead, so that its time in the profile is the kernel's alone.
    compiled = jax.jit(fn).lower(*[jax.ShapeDtypeStruct(x.shape, x.dtype)
                                   for x in xs]).compile()

    def run(*arrays):
      return [np.asarray(o) for o in jax.block_until_ready(compiled(*arrays))]
    return _in_callback(run, spec, axis_context)(*xs)
  return on_host
