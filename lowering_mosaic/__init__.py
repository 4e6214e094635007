"""lowering_mosaic: kernels as Mosaic MLIR, for TPUs and NVIDIA GPUs.

- `tpu/`: the Mosaic TPU lowering and its launches; importing it registers
  backends "mosaic" (the module in a `tpu_custom_call`) and
  "mosaic_interpret" (the module run on the host by the interpreter below).
  `build_module(spec)`, `check_tpu_rules(spec)`, `to_mlir(f, *args)`,
  `to_modules(f, *args)`, `dump_module`, `module_text`.
- `gpu/`: the Mosaic GPU lowering; importing it registers "mosaic_gpu"
  (it loads neither the TPU lowering nor the verification tools).
- `verification/`: the MLIR interpreter (simulated DMA engines, semaphores,
  a race checker and several devices: `interpreter_options`,
  `InterpreterOptions`) and the Promela exporter for SPIN;
  `lowering_mosaic.verify` is their command line and API.

The names above are this package's attributes, loaded from their
sub-package the first time they are asked for, so that importing one
backend does not load the others. See docs/mosaic.md.
"""
import importlib

from dsl.core.errors import hide_package_frames as _hide

_hide(__file__)   # JAX's traceback filtering leaves our frames out

# attribute -> the module that defines it (a module itself where the value
# is None).
_LAZY = {
    "build_module": "lowering_mosaic.tpu",
    "check_tpu_rules": "lowering_mosaic.tpu",
    "dump_module": "lowering_mosaic.tpu",
    "module_text": "lowering_mosaic.tpu",
    "to_mlir": "lowering_mosaic.tpu",
    "to_modules": "lowering_mosaic.tpu",
    "InterpreterOptions": "lowering_mosaic.verification.interpreter",
    "KernelDeadlockError": "lowering_mosaic.verification.interpreter",
    "KernelRaceError": "lowering_mosaic.verification.interpreter",
    "KernelSimulationError": "lowering_mosaic.verification.interpreter",
    "interpreter_options": "lowering_mosaic.verification.interpreter",
    # modules (docs name them by these paths)
    "verify": None,
    "interpreter": None,
    "promela": None,
}
_MODULES = {"verify": "lowering_mosaic.verify",
            "interpreter": "lowering_mosaic.verification.interpreter",
            "promela": "lowering_mosaic.verification.promela"}

__all__ = [n for n, m in _LAZY.items() if m is not None]


def __getattr__(name):
  if name not in _LAZY:
    raise AttributeError(f"module 'lowering_mosaic' has no attribute {name!r}")
  if _LAZY[name] is None:
    return importlib.import_module(_MODULES[name])
  return getattr(importlib.import_module(_LAZY[name]), name)
