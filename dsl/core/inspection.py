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


def kernel_specs(jaxpr: core.Jaxpr, mesh_axes: tuple = (),
                 platform: str | None = None
                 ) -> Iterator[tuple[KernelSpec, tuple]]:
  """Yields (KernelSpec, mesh axes) of every pallas_call in `jaxpr`, in
  program order, looking inside every sub-jaxpr. Of a
  `jax.lax.platform_dependent` choice (the kernel library's versions per
  platform), only the version for `platform` (a lowering platform; None:
  this process's) counts, as only it is lowered."""
  platform = backends.lowering_platform(platform)
  choices = {}
  for eqn in jaxpr.eqns:
    if eqn.primitive is pallas_call_p:
      yield eqn.params["spec"], mesh_axes
      continue
    if eqn.primitive.name == "platform_index":
      choices[eqn.outvars[0]] = eqn.params
      continue
    inner_mesh = mesh_axes
    if "mesh" in eqn.params and eqn.primitive.name == "shard_map":
      inner_mesh = mesh_axes_of(eqn.params["mesh"])
    subs = list(sub_jaxprs(eqn.params))
    index = eqn.invars[0] if eqn.invars else None
    if eqn.primitive.name == "cond" and isinstance(index, core.Var) and \
        index in choices:
      subs = _platform_branch(subs, choices[index], platform)
    for sub in subs:
      yield from kernel_specs(sub, inner_mesh, platform)


def _platform_branch(branches: list, params: dict, platform: str) -> list:
  """The branch of a platform_dependent cond that `platform` runs."""
  for k, names in enumerate(params["platforms"]):
    if platform in names:
      return [branches[k]]
  return branches[-1:] if params.get("has_default") else []


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
