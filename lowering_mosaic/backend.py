"""The two Mosaic backends registered with dsl.

- "mosaic": the module, serialized, in a `tpu_custom_call` (what a TPU runs);
  built with `jax._src.tpu_custom_call.lower_module_to_custom_call`.
- "mosaic_interpret": the same module run on the host by our interpreter
  through `jax.pure_callback`. Partitioned by a sharded `jax.jit`, each
  device simulates its own part alone. Inside `shard_map`, every operand is
  all-gathered over the mesh, one callback simulates every device of the
  launch (the devices' callbacks share that one simulation), and each
  device keeps its own slice of the outputs.
"""
from __future__ import annotations

import hashlib
import math
import re
import threading

import jax
import numpy as np
from jax import lax
from jax._src import core, sharding_impls
from jax._src.interpreters import mlir

from dsl import backends, checks, host_failures
from dsl.errors import (BackendError, KernelCheckError, KernelDeadlockError,
                        KernelError, KernelRaceError, KernelRuntimeError)
from lowering_mosaic import interpreter as interp
from lowering_mosaic import promela
from lowering_mosaic.inspection import dump_module, mesh_axes_of
from lowering_mosaic.interpreter.run import cached_program, simulate
from lowering_mosaic.lowering import (build_module_and_context, entry_name,
                                      module_text, strip_annotations)


def _num_devices(mesh_axes) -> int:
  return math.prod(s for _, s in mesh_axes) if mesh_axes else 1


def mesh_axes_from_context(ctx, spec, on_host: bool = False) -> tuple:
  """((axis, size), ...) of the shard_map mesh the kernel runs in, or ().

  Under a sharded `jax.jit` (no shard_map) a kernel partitions itself
  (dsl/partitioning.py) and each device runs its part alone (`spec.local`).
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


def _tpu_params(spec):
  from dsl import tpu
  p = spec.compiler_params
  return p if isinstance(p, tpu.CompilerParams) else tpu.CompilerParams()


def _barrier_tag(spec):
  """`get_barrier_semaphore(tag=...)`'s tag: it names the collective (JAX
  gives each tag its collective id; one with `collective_id` is JAX's
  ValueError)."""
  from dsl.semaphores import barrier_tag
  return barrier_tag(spec.jaxpr.jaxpr, spec.name, spec.where)


# ------------------------------------------------------------ "mosaic"

def mosaic_lowering(ctx, *args, spec):
  from jax._src import tpu_custom_call
  platforms = tuple(ctx.module_context.platforms or ())
  if "tpu" not in platforms:
    raise BackendError(
        spec.name, f"backend 'mosaic' lowers for TPUs, but this computation "
        f"is lowered for {', '.join(platforms) or 'no platform'}; use "
        "backend='mosaic_interpret' to run the Mosaic module on the host",
        spec.where)
  mesh_axes = mesh_axes_from_context(ctx, spec)
  module, lctx = build_module_and_context(spec, mesh_axes)
  dump_module(spec, module)
  promela.maybe_dump(module, spec.name, num_devices=_num_devices(mesh_axes))
  params = _tpu_params(spec)
  collective_id = params.collective_id
  tag = _barrier_tag(spec)
  if lctx.uses_barrier and collective_id is None and tag is None:
    collective_id = 0
  out_avals = tuple(_in_memory(core.ShapedArray(a.shape, a.dtype))
                    for a in spec.grid_mapping.out_avals)
  allow_fusion = (list(params.allow_input_fusion)
                  if params.allow_input_fusion is not None else None)
  # booleans cross the call as int32 (the kernel's memrefs hold i32)
  in_avals = [_in_memory(a) for a in ctx.avals_in]
  args = mlir.lower_fun(_cast_all(in_avals), multiple_results=True)(
      ctx.replace(avals_out=in_avals), *args)
  outs = tpu_custom_call.lower_module_to_custom_call(
      ctx.replace(avals_in=in_avals, avals_out=list(out_avals)), *args,
      module=strip_annotations(module), out_type=out_avals,
      kernel_name=entry_name(spec), cost_estimate=cost_estimate_of(spec),
      vmem_limit_bytes=params.vmem_limit_bytes,
      flags=dict(params.flags) if params.flags else None,
      allow_input_fusion=allow_fusion,
      input_output_aliases=tuple(spec.input_output_aliases),
      internal_scratch_in_bytes=params.internal_scratch_in_bytes,
      collective_id=collective_id, collective_id_tag=tag,
      has_side_effects=bool(params.has_side_effects),
      serialization_format=1, output_memory_spaces=None,
      disable_bounds_checks=bool(params.disable_bounds_checks),
      input_memory_spaces=None, metadata=kernel_metadata(lctx),
      shape_invariant_numerics=bool(params.shape_invariant_numerics))
  return mlir.lower_fun(_cast_all(ctx.avals_out), multiple_results=True)(
      ctx.replace(avals_in=list(out_avals)), *outs)


def _in_memory(aval):
  """The aval a kernel operand has at the call: booleans as int32."""
  if aval.dtype == np.bool_:
    return core.ShapedArray(aval.shape, np.int32)
  return aval


def _cast_all(avals):
  def cast(*xs):
    return [x if x.dtype == a.dtype else x.astype(a.dtype)
            for x, a in zip(xs, avals)]
  return cast


_COST_FIELDS = ("flops", "transcendentals", "bytes_accessed",
                "remote_bytes_transferred")


def cost_estimate_of(spec):
  """`pallas_call(cost_estimate=...)` as the custom call's cost estimate (a
  CostEstimate, or any object or dict with its fields), or None."""
  c = spec.cost_estimate
  if c is None:
    return None
  get = c.get if isinstance(c, dict) else (lambda k, d: getattr(c, k, d))
  est = {}
  for k in _COST_FIELDS:
    v = get(k, 0 if k == "remote_bytes_transferred" else None)
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
      raise KernelError(spec.name, f"cost_estimate.{k} must be an int, got "
                        f"{v!r}", spec.where, operand="cost_estimate")
    est[k] = int(v)
  return est


def kernel_metadata(lctx) -> dict:
  """The call's `kernel_metadata`: the mesh axes the kernel names, as
  Pallas records them."""
  import json
  if lctx.named_axes:
    return {"mesh_axes": json.dumps(sorted(lctx.named_axes))}
  return {}


# ------------------------------------------------------------ interpret

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
_PREFIX = re.compile(r"^kernel '[^']*'(?: on (device \d+))?: ", re.S)


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
    interp._LAST_FAILURE.append(e)
    raise kernel_error(e, kernel) from e
  interp._REPORTS.extend(world.reports)
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
  promela.maybe_dump(module, spec.name, num_devices=_num_devices(mesh_axes))
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


backends.register_backend("mosaic", mosaic_lowering)
backends.register_backend("mosaic_interpret", interpret_lowering)
