"""Backend "mosaic": the module, serialized, in a `tpu_custom_call` (what a
TPU runs); built with `jax._src.tpu_custom_call.lower_module_to_custom_call`.
(Backend "mosaic_interpret" runs the same module on the host:
interpret_launch.py.)
"""
from __future__ import annotations

import json

import numpy as np
from dsl.core.jax_internals import core, mlir, tpu_custom_call

from dsl import tpu
from dsl.core import config
from dsl.core.errors import BackendError, KernelError
from dsl.core.device_launch import mesh_axes_from_context, num_devices
from dsl.core.semaphores import barrier_tag
from lowering_mosaic.tpu.mlir_modules import dump_module
from lowering_mosaic.tpu.lowering import (build_module_and_context, entry_name,
                                          strip_annotations)
from lowering_mosaic.unchecked_windows import refusal
from lowering_mosaic.verification import promela


def _tpu_params(spec):
  p = spec.compiler_params
  return p if isinstance(p, tpu.CompilerParams) else tpu.CompilerParams()


def _barrier_tag(spec):
  """`get_barrier_semaphore(tag=...)`'s tag: it names the collective (JAX
  gives each tag its collective id; one with `collective_id` is JAX's
  ValueError)."""
  return barrier_tag(spec.jaxpr.jaxpr, spec.name, spec.where)


# ------------------------------------------------------------ "mosaic"

def mosaic_lowering(ctx, *args, spec):
  platforms = tuple(ctx.module_context.platforms or ())
  if "tpu" not in platforms:
    raise BackendError(
        spec.name, f"backend 'mosaic' lowers for TPUs, but this computation "
        f"is lowered for {', '.join(platforms) or 'no platform'}; use "
        "backend='mosaic_interpret' to run the Mosaic module on the host",
        spec.where)
  mesh_axes = mesh_axes_from_context(ctx, spec)
  module, lctx = build_module_and_context(spec, mesh_axes)
  if lctx.unchecked_windows and config.enable_runtime_assert():
    raise refusal(spec.name, "the TPU", *lctx.unchecked_windows[0],
                  "backend='mosaic_interpret' or 'interpret'")
  dump_module(spec, module)
  promela.maybe_dump(module, spec.name, num_devices=num_devices(mesh_axes))
  params = _tpu_params(spec)
  collective_id = params.collective_id
  tag = _barrier_tag(spec)
  if lctx.uses_barrier and collective_id is None and tag is None:
    collective_id = 0
  out_avals = tuple(_in_memory(core.ShapedArray(a.shape, a.dtype))
                    for a in spec.grid_mapping.out_avals)
  allow_fusion = (list(params.allow_input_fusion)
                  if params.allow_input_fusion is not None else None)
  # booleans cross the call as int32 (the kernel's memrefs hold i32); the
  # sizes of dynamic grid dims lead the operands (as Mosaic reads them)
  in_avals = [_in_memory(a) for a in ctx.avals_in]
  n_sizes = len(spec.grid_mapping.dynamic_dims)
  args = mlir.lower_fun(_cast_all(in_avals), multiple_results=True)(
      ctx.replace(avals_out=in_avals), *args)
  outs = tpu_custom_call.lower_module_to_custom_call(
      ctx.replace(avals_in=in_avals, avals_out=list(out_avals)), *args,
      module=strip_annotations(module), out_type=out_avals,
      kernel_name=entry_name(spec), cost_estimate=cost_estimate_of(spec),
      vmem_limit_bytes=params.vmem_limit_bytes,
      flags=dict(params.flags) if params.flags else None,
      allow_input_fusion=allow_fusion,
      input_output_aliases=tuple((i + n_sizes, o)
                                 for i, o in spec.input_output_aliases),
      internal_scratch_in_bytes=params.internal_scratch_in_bytes,
      collective_id=collective_id, collective_id_tag=tag,
      has_side_effects=bool(params.has_side_effects),
      serialization_format=1, output_memory_spaces=None,
      disable_bounds_checks=bool(params.disable_bounds_checks),
      input_memory_spaces=None, metadata=kernel_metadata(spec, lctx),
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


def kernel_metadata(spec, lctx) -> dict:
  """The call's `kernel_metadata`: `pallas_call(metadata=)` and the mesh
  axes the kernel names, as Pallas records them."""
  meta = dict(spec.metadata)
  if lctx.named_axes:
    if "mesh_axes" in meta:
      raise KernelError(spec.name, "metadata has a 'mesh_axes' entry, which "
                        "the lowering fills with the mesh axes the kernel "
                        "names", spec.where, operand="metadata")
    meta["mesh_axes"] = json.dumps(sorted(lctx.named_axes))
  return meta
