"""lowering_mosaic.gpu: kernels as Mosaic GPU modules for NVIDIA Hopper GPUs.

Built on jaxlib's library `jax.experimental.mosaic.gpu` (warpgroup
semantics: the `mosaic_gpu` dialect, its layout inference, TMA copies,
mbarriers, `wgmma`). Importing the package registers backend "mosaic_gpu";
`jax_pallas_use_mosaic_gpu=True` makes it the default for CUDA.

- `build_gpu_module(spec)`: KernelSpec -> GpuModule (kernel.py, rules/)
- `build_mesh_module(spec)`: a `plgpu.kernel`'s KernelSpec -> GpuModule
  (mesh_kernel.py, rules/plgpu.py); `build_module` picks one of the two
- `to_gpu_modules(f, *args)`: the GpuModules of the pallas_calls in `f`
  (also written to `jax_pallas_dump_mlir_to` when set)

See docs/mosaic-gpu.md.
"""
import jax
from dsl.core.jax_internals import ir
from jax.interpreters import mlir

from dsl.core import backends as _backends
from dsl.core.inspection import as_lowered, traced_kernels
from lowering_mosaic.gpu import rules as _rules  # noqa: F401 (fills TABLE)
from lowering_mosaic.gpu.rules import TABLE
from lowering_mosaic.gpu.kernel import GpuModule, build_gpu_module
from lowering_mosaic.gpu.plan import GpuPlan, make_gpu_plan
from lowering_mosaic.gpu.launch import (build_module, dump_gpu_module,
                                       mosaic_gpu_lowering)

_backends.register_backend("mosaic_gpu", mosaic_gpu_lowering, rules=TABLE)


def _device_mesh(mesh_axes):
  """The (abstract) device mesh of the shard_map over `mesh_axes`."""
  if not mesh_axes:
    return None
  names, sizes = zip(*mesh_axes)
  return jax.sharding.AbstractMesh(tuple(sizes), tuple(names))


def to_gpu_modules(f, *args, **kwargs) -> list[GpuModule]:
  """The Mosaic GPU modules of the pallas_calls in `f(*args)`, built in a
  context of JAX's (a bare `ir.Context()` lacks the dialects)."""
  out = []
  with mlir.make_ir_context(), ir.Location.unknown():
    for spec, mesh_axes in traced_kernels(f, *args, **kwargs):
      spec = as_lowered(spec, "mosaic_gpu", mesh_axes)
      out.append(build_module(spec, _device_mesh(mesh_axes)))
      dump_gpu_module(spec, out[-1])
  return out


from lowering_mosaic.gpu.mesh_kernel import MeshPlan, build_mesh_module

__all__ = ["TABLE", "GpuModule", "GpuPlan", "MeshPlan", "build_gpu_module",
           "build_mesh_module", "build_module",
           "make_gpu_plan", "to_gpu_modules"]
