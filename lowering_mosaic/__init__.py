"""lowering_mosaic: kernels as Mosaic-dialect MLIR for TPUs.

- `build_module(spec)`: KernelSpec -> verified MLIR module (lowering.py, rules/)
- `check_tpu_rules(spec)`: TPU tiling / VMEM / SMEM rules (tpu_rules.py)
- `to_mlir(f, *args)`: the module text of the pallas_calls in `f`
- backend "mosaic": the module in a `tpu_custom_call` (TPU lowering)
- backend "mosaic_interpret": the module run on CPU by our MLIR interpreter,
  with simulated DMA engines, semaphores, a race checker and several devices
  (interpreter/)

Importing the package registers both backends with dsl. See docs/mosaic.md.
"""
from dsl.errors import hide_package_frames as _hide

_hide(__file__)   # JAX's traceback filtering leaves our frames out
from dsl import backends as _backends
from lowering_mosaic.tpu import rules as _rules  # noqa: F401 (fills the table)
from lowering_mosaic.tpu.constraints import check_tpu_rules
from lowering_mosaic.tpu.inspection import dump_module, to_mlir, to_modules
from lowering_mosaic.tpu.lowering import build_module, module_text
from lowering_mosaic.tpu import launch as _backend
from lowering_mosaic.tpu.rules import TABLE as _TABLE
from lowering_mosaic.verification.interpreter import (InterpreterOptions,
                                                      KernelDeadlockError,
                                                      KernelRaceError,
                                                      KernelSimulationError,
                                                      interpreter_options)

__all__ = ["build_module", "check_tpu_rules", "dump_module", "module_text",
           "to_mlir", "to_modules", "InterpreterOptions",
           "KernelDeadlockError", "KernelRaceError", "KernelSimulationError",
           "interpreter_options"]


_backends.register_backend("mosaic", _backend.mosaic_lowering, rules=_TABLE)
_backends.register_backend("mosaic_interpret", _backend.interpret_lowering,
                           rules=_TABLE)


def __getattr__(name):
  # `lowering_mosaic.verify(f, *args)`; imported lazily so that
  # `python -m lowering_mosaic.verify` runs without a runpy warning.
  if name == "verify":
    import importlib
    return importlib.import_module("lowering_mosaic.verify")
  raise AttributeError(name)
