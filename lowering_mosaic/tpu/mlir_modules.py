"""Looking at the MLIR: `to_mlir(f, *args)` and `jax_pallas_dump_mlir_to`."""
from __future__ import annotations

import hashlib
import os

from dsl.core import config
from dsl.core.inspection import as_lowered, traced_kernels
from lowering_mosaic.tpu.lowering import build_module, module_text


def to_modules(f, *args, **kwargs):
  """The Mosaic modules (ir.Module) of the pallas_calls in `f(*args)`."""
  return [module_of(spec, mesh_axes)
          for spec, mesh_axes in traced_kernels(f, *args, **kwargs)]


def module_of(spec, mesh_axes=()):
  """The Mosaic module of one traced kernel (written to
  `jax_pallas_dump_mlir_to` when set)."""
  spec = as_lowered(spec, "mosaic", mesh_axes)
  module = build_module(spec, mesh_axes)
  dump_module(spec, module)
  return module


def to_mlir(f, *args, debug_info: bool = False, **kwargs) -> str:
  """The MLIR text of the Mosaic module of every pallas_call in `f(*args)`.

  With `debug_info=True` each operation shows its source location (the
  kernel's line).
  """
  return "\n".join(module_text(m, debug_info) for m in
                   to_modules(f, *args, **kwargs))


def dump_module(spec, module) -> str | None:
  """Writes the module to `jax_pallas_dump_mlir_to` if set; returns the path."""
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
