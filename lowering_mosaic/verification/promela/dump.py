"""`jax_pallas_dump_promela_to=DIR`: every Mosaic-lowered kernel's model.

The Mosaic backends (`mosaic`, `mosaic_interpret`) call `maybe_dump` on
each module they build, and `lowering_mosaic.verify` `maybe_dump_text` on
each model it checks; it costs nothing when the option is unset.
"""
from __future__ import annotations

import warnings
from typing import Optional
from dsl.core import config
from lowering_mosaic.model_files import write_model
from lowering_mosaic.verification.promela.builder import to_promela


def dump_directory() -> str:
  return config.dump_promela_to()


def kernel_name_of(module) -> str:
  """The kernel's name recorded in a Mosaic module (its function's
  `dsl.kernel_name`, else the function's symbol), or "kernel"."""
  for op in module.body.operations:
    attrs = op.attributes
    for key in ("dsl.kernel_name", "sym_name"):
      if key in attrs:
        return str(attrs[key]).strip('"') or "kernel"
  return "kernel"


def maybe_dump_text(text: str, kernel_name: str) -> Optional[str]:
  """Writes a model already made (by `lowering_mosaic.verify`, with its
  options) when `jax_pallas_dump_promela_to` is set; returns the path."""
  directory = dump_directory()
  return write_model(text, kernel_name, directory) if directory else None


def maybe_dump(module, kernel_name: str, num_devices: Optional[int] = None
               ) -> Optional[str]:
  """Writes the Promela model of `module` when `jax_pallas_dump_promela_to`
  is set; returns the path (None when unset).

  `num_devices`: how many devices run the kernel; None takes the module's
  shard_map mesh (`dsl.mesh_shape`), or 1. A kernel the export cannot model
  gives a warning, never a failed lowering.
  """
  directory = dump_directory()
  if not directory:
    return None
  try:
    text = to_promela(module, num_devices)
  except Exception as e:  # noqa: BLE001 - a dump must not break lowering
    warnings.warn(f"jax_pallas_dump_promela_to: no Promela model for kernel "
                  f"{kernel_name}: {e}", RuntimeWarning, stacklevel=2)
    return None
  return write_model(text, kernel_name, directory)
