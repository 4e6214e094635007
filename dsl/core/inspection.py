"""The kernels a function makes, as a backend's lowering receives them.

`traced_kernels(f, *args)` traces `f` and returns the KernelSpec of every
pallas_call in it, in program order, each with the axes of the `shard_map`
mesh it runs in (`((name, size), ...)`, () outside one); `as_lowered(spec,
backend, mesh_axes)` is the spec that backend's lowering rule receives (its
kernel jaxpr normalized as the backend's registry record says). The tools
that show generated code without running it (`lowering_triton.to_source`,
`lowering_mosaic.to_mlir`, `lowering_mosaic.gpu.to_gpu_modules`) use both,
so what they show is what the lowering builds.

`traced_kernel_calls(f, *args)` also says which of `f`'s inputs each kernel
reads (directly or through a reshape, transpose, slice or cast of them):
how many passes over its inputs a function makes.
"""
from __future__ import annotations

import dataclasses
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


# Primitives whose result is (part of) its first operand's data, laid out
# again: a kernel that reads the result reads that operand.
VIEW_PRIMITIVES = frozenset({
    jax.lax.reshape_p, jax.lax.squeeze_p, jax.lax.transpose_p,
    jax.lax.broadcast_in_dim_p, jax.lax.convert_element_type_p,
    jax.lax.copy_p, jax.lax.slice_p, jax.lax.dynamic_slice_p})


@dataclasses.dataclass(frozen=True)
class KernelCall:
  """One pallas_call of a traced function."""
  spec: KernelSpec
  mesh_axes: tuple            # ((axis name, size), ...) of its shard_map
  reads_inputs: tuple[int, ...]   # its operands that are the function's
  # inputs or views of them (VIEW_PRIMITIVES), by position


def kernel_specs(jaxpr: core.Jaxpr, mesh_axes: tuple = (),
                 platform: str | None = None
                 ) -> Iterator[tuple[KernelSpec, tuple]]:
  """Yields (KernelSpec, mesh axes) of every pallas_call in `jaxpr`, in
  program order, looking inside every sub-jaxpr. Of a
  `jax.lax.platform_dependent` choice (the kernel library's versions per
  platform), only the version for `platform` (a lowering platform; None:
  this process's) counts, as only it is lowered."""
  for call in kernel_calls(jaxpr, (), mesh_axes, platform):
    yield call.spec, call.mesh_axes


def kernel_calls(jaxpr: core.Jaxpr, watched=(), mesh_axes: tuple = (),
                 platform: str | None = None) -> list[KernelCall]:
  """The pallas_calls of `jaxpr` as `kernel_specs` finds them, each with
  the operands it reads of `watched` (vars of `jaxpr`) or of their views."""
  out = []
  _walk(jaxpr, set(watched), mesh_axes,
        backends.lowering_platform(platform), out)
  return out


def traced_kernel_calls(f, *args, **kwargs) -> list[KernelCall]:
  """The pallas_calls `f(*args, **kwargs)` makes, in program order, with
  the operands each reads of `f`'s (array) inputs."""
  closed = jax.make_jaxpr(f)(*args, **kwargs)
  return kernel_calls(closed.jaxpr, closed.jaxpr.invars)


def _walk(jaxpr, watched: set, mesh_axes, platform, out: list) -> list:
  """Appends `jaxpr`'s KernelCalls to `out`; returns whether each of its
  outputs is watched."""
  choices = {}
  for eqn in jaxpr.eqns:
    ins = [isinstance(v, core.Var) and v in watched for v in eqn.invars]
    if eqn.primitive is pallas_call_p:
      out.append(KernelCall(eqn.params["spec"], mesh_axes,
                            tuple(i for i, w in enumerate(ins) if w)))
      continue
    if eqn.primitive.name == "platform_index":
      choices[eqn.outvars[0]] = eqn.params
      continue
    if eqn.primitive in VIEW_PRIMITIVES and ins[0]:
      watched.update(eqn.outvars)
    inner_mesh = mesh_axes
    if "mesh" in eqn.params and eqn.primitive.name == "shard_map":
      inner_mesh = mesh_axes_of(eqn.params["mesh"])
    subs = list(sub_jaxprs(eqn.params))
    index = eqn.invars[0] if eqn.invars else None
    if eqn.primitive.name == "cond" and isinstance(index, core.Var) and \
        index in choices:
      subs = _platform_branch(subs, choices[index], platform)
    for sub in subs:
      # A sub-jaxpr's inputs are the trailing operands (after a cond's
      # index, a while's condition consts).
      fed = ins[len(ins) - len(sub.invars):] if len(sub.invars) <= len(
          ins) else []
      outs = _walk(sub, {v for v, w in zip(sub.invars, fed) if w},
                   inner_mesh, platform, out)
      if len(outs) == len(eqn.outvars):
        watched.update(v for v, w in zip(eqn.outvars, outs) if w)
  return [isinstance(v, core.Var) and v in watched for v in jaxpr.outvars]


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
