"""The "mosaic_gpu" backend: the module in Mosaic GPU's custom call.

The custom call (`mosaic_gpu_v2`) is the one jaxlib's library emits for its
own kernels (`core._mosaic_gpu_lowering_rule`): the module is serialized
into the call's backend config, and XLA's Mosaic GPU plugin compiles it to
PTX/cubin when the computation is compiled for a GPU.
"""
from __future__ import annotations

import hashlib
import os

import jax.numpy as jnp
from dsl.core.jax_internals import core, mlir, sharding_impls
from jax.experimental.mosaic.gpu import core as mgpu_core

from dsl.core.errors import BackendError
from lowering_mosaic.gpu import plgpu_promela
from lowering_mosaic.gpu.kernel import GpuModule, build_gpu_module
from lowering_mosaic.gpu.plan import GpuPlan
from lowering_mosaic.gpu.mesh_kernel import build_mesh_module, is_mesh_kernel
from dsl.core import config


def build_module(spec, jax_mesh=None) -> GpuModule:
  """The module of `spec`: a `plgpu.kernel` (mesh_kernel.py; `jax_mesh`:
  the device mesh of the shard_map it runs in) or a pallas_call whose
  schedule the lowering chooses (kernel.py)."""
  if is_mesh_kernel(spec):
    return build_mesh_module(spec, jax_mesh)
  return build_gpu_module(spec)


def dump_gpu_module(spec, built: GpuModule) -> str | None:
  """Writes the dialect-level module and the lowered one to
  `jax_pallas_dump_mlir_to` if set; returns the first path. (A
  `plgpu.kernel`'s protocol model goes to `jax_pallas_dump_promela_to`.)"""
  plgpu_promela.maybe_dump(spec)
  directory = config.dump_mlir_to()
  if not directory:
    return None
  lowered = built.module.operation.get_asm(enable_debug_info=True)
  digest = hashlib.sha1(built.dialect_text.encode()).hexdigest()[:8]
  os.makedirs(directory, exist_ok=True)
  head = (f"// kernel {spec.name} defined at {spec.kernel_src}, called at "
          f"{spec.where}\n// Mosaic GPU, {built.plan.summary()}\n")
  first = os.path.join(directory, f"{spec.name}-{digest}.mosaic_gpu.mlir")
  with open(first, "w") as fh:
    fh.write(head + "// stage: mosaic_gpu dialect, before layout inference\n")
    fh.write(built.dialect_text)
  with open(os.path.join(directory, f"{spec.name}-{digest}.mosaic_gpu."
                         "lowered.mlir"), "w") as fh:
    fh.write(head + "// stage: layouts inferred, dialect lowered\n")
    fh.write(lowered)
  return first


def mosaic_gpu_lowering(ctx, *args, spec):
  platforms = tuple(ctx.module_context.platforms or ())
  if "cuda" not in platforms:
    raise BackendError(
        spec.name, "backend 'mosaic_gpu' lowers for NVIDIA GPUs (cuda), but "
        f"this computation is lowered for {', '.join(platforms) or 'none'}; "
        "use backend='interpret' elsewhere", spec.where)
  built = build_module(spec, _device_mesh(ctx))
  dump_gpu_module(spec, built)
  ctx, args = _stacked_operands(ctx, args, built)
  scratch = getattr(built.plan, "gmem_scratch", ())
  aliases = tuple(spec.input_output_aliases)
  if scratch:
    ctx, args, aliases = _with_gmem_scratch(ctx, args, aliases, scratch)
  outs = mgpu_core._mosaic_gpu_lowering_rule(
      ctx, *args, module=built.module, out_types=built.out_shapes,
      inout_types=(), input_output_aliases=aliases)
  return outs[:len(outs) - len(scratch)]


def _device_mesh(ctx):
  """The device mesh of the shard_map being lowered (None outside one)."""
  ac = ctx.module_context.axis_context
  if isinstance(ac, sharding_impls.SPMDAxisContext):
    return ac.mesh
  return None


def _with_gmem_scratch(ctx, args, aliases, scratch):
  """The custom call's operands with the kernel's global-memory semaphore
  buffers after them: zeros (each launch's semaphores start at 0), each
  aliased to an extra output (dropped after the call)."""
  n_in, n_out = len(ctx.avals_in), len(ctx.avals_out)
  avals = [core.ShapedArray(s.shape, s.dtype) for s in scratch]
  zeros = mlir.lower_fun(lambda: [jnp.zeros(s.shape, s.dtype)
                                  for s in scratch],
                         multiple_results=True)(ctx.replace(avals_in=()))
  aliases += tuple((n_in + i, n_out + i) for i in range(len(scratch)))
  ctx = ctx.replace(avals_in=[*ctx.avals_in, *avals],
                    avals_out=[*ctx.avals_out, *avals])
  return ctx, [*args, *zeros], aliases


def _stacked_operands(ctx, args, built: GpuModule):
  """The operands as the module takes them: those of stacked blocks
  reshaped to their `stacked_shape` (a view of the same bytes: plan.py)."""
  plan = built.plan
  if not isinstance(plan, GpuPlan):      # a plgpu.kernel's: no blocks
    return ctx, args
  blocks = [b for b in plan.blocks if not b.is_output]
  if not any(b.stacked for b in blocks):
    return ctx, args
  args, avals = list(args), list(ctx.avals_in)
  first = len(plan.prefetch)
  for k, b in enumerate(blocks, first):
    if b.stacked:
      avals[k] = core.ShapedArray(b.stacked_shape, avals[k].dtype)
      args[k] = mlir.reshape(ctx, args[k], avals[k])
  return ctx.replace(avals_in=avals), args
