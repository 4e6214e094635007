"""Looking at the MLIR: `to_mlir(f, *args)` and `jax_pallas_dump_mlir_to`."""
from __future__ import annotations

import hashlib
import os

import jax
from jax._src import core

from dsl.checks import sub_jaxprs as _sub_jaxprs
from lowering_mosaic.lowering import build_module, module_text


def mesh_axes_of(mesh) -> tuple:
  """((axis name, size), ...) of a jax Mesh / AbstractMesh."""
  shape = getattr(mesh, "shape", None)
  if shape is None:
    return ()
  return tuple((n, int(s)) for n, s in dict(shape).items())


def kernel_specs(jaxpr: core.Jaxpr, mesh_axes=()):
  """Yields (KernelSpec, mesh axes) of every pallas_call in `jaxpr`."""
  from dsl.pallas_call import pallas_call_p
  for eqn in jaxpr.eqns:
    if eqn.primitive is pallas_call_p:
      yield eqn.params["spec"], mesh_axes
      continue
    inner_mesh = mesh_axes
    if "mesh" in eqn.params and eqn.primitive.name == "shard_map":
      inner_mesh = mesh_axes_of(eqn.params["mesh"])
    for sub in _sub_jaxprs(eqn.params):
      yield from kernel_specs(sub, inner_mesh)


def to_modules(f, *args, **kwargs):
  """The Mosaic modules (ir.Module) of the pallas_calls in `f(*args)`."""
  from dsl.normalize import normalize
  closed = jax.make_jaxpr(f)(*args, **kwargs)
  mods = []
  for spec, mesh_axes in kernel_specs(closed.jaxpr):
    with core.extend_axis_env_nd(list(mesh_axes)):   # as lowering does
      spec = normalize(spec, values_in_memory=True)
    module = build_module(spec, mesh_axes)
    dump_module(spec, module)
    mods.append(module)
  return mods


def to_mlir(f, *args, debug_info: bool = False, **kwargs) -> str:
  """The MLIR text of the Mosaic module of every pallas_call in `f(*args)`.

  With `debug_info=True` each operation shows its source location (the
  kernel's line).
  """
  return "\n".join(module_text(m, debug_info) for m in
                   to_modules(f, *args, **kwargs))


def dump_module(spec, module) -> str | None:
  """Writes the module to `jax_pallas_dump_mlir_to` if set; returns the path."""
  from dsl import config
  directory = config.dump_mlir_to()
  if not directory:
    return None
  text = module_text(module, debug_info=True)
  digest = hashlib.sha1(text.encode()).hexdigest()[:8]
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, f"{spec.name}-{digest}.mlir")
  with open(path, "w") as fh:
    fh.write(f"// kernel {spec.name} defined at {spec.kernel_src}, called at "
             f"{spec.where}\n")
    fh.write(text)
  return path
