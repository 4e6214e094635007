"""The kernels a function makes, as a backend's lowering receives them.

`traced_kernels(f, *args)` traces `f` and returns the KernelSpec of every
pallas_call in it, in program order, each with the axes of the `shard_map`
mesh it runs in (`((name, size), ...)`, () outside one); `as_lowered(spec,
backend, mesh_axes)` is the spec that backend's lowering rule receives (its
kernel jaxpr normalized as the backend's registry record says). The tools
that show generated code without running it (`lowering_triton.to_source`,
`lowering_mosaic.to_mlir`, `lowering_mosaic.gpu.to_gpu_modules`) use both,
so what they show is what the lowering builds.
"""
from __future__ import annotations

from typing import Iterator

import jax
from dsl.core.jax_internals import core

from dsl.core import backends
from dsl.core.jaxpr_walk import sub_jaxprs
from dsl.core.pallas_call import KernelSpec, pallas_call_p


def mesh_axes_of(mesh) -> tuple:
  """((axis name, size), ...) of a jax Mesh / AbstractMesh."""
  shape = getattr(mesh, "shape", None)
  if shape is None:
    return ()
  return tuple((n, int(s)) for n, s in dict(shape).items())


def kernel_specs(jaxpr: core.Jaxpr, mesh_axes: tuple = ()
                 ) -> Iterator[tuple[KernelSpec, tuple]]:
  """Yields (KernelSpec, mesh axes) of every pallas_call in `jaxpr`, in
  program order, looking inside every sub-jaxpr."""
  for eqn in jaxpr.eqns:
    if eqn.primitive is pallas_call_p:
      yield eqn.params["spec"], mesh_axes
      continue
    inner_mesh = mesh_axes
    if "mesh" in eqn.params and eqn.primitive.name == "shard_map":
      inner_mesh = mesh_axes_of(eqn.params["mesh"])
    for sub in sub_jaxprs(eqn.params):
      yield from kernel_specs(sub, inner_mesh)


def traced_kernels(f, *args, **kwargs) -> list[tuple[KernelSpec, tuple]]:
  """(KernelSpec, mesh axes) of each pallas_call `f(*args, **kwargs)`
  makes, in program order."""
  closed = jax.make_jaxpr(f)(*args, **kwargs)
  return list(kernel_specs(closed.jaxpr))


def as_lowered(spec: KernelSpec, backend: str,
               mesh_axes: tuple = ()) -> KernelSpec:
  """`spec` as the lowering of `backend` receives it, inside a shard_map
  over `mesh_axes` (whose names its jaxpr may use)."""
  with core.extend_axis_env_nd(list(mesh_axes)):
    return backends.prepare(spec, backend)
