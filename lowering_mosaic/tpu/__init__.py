"""The Mosaic TPU lowering: kernels as Mosaic-dialect MLIR.

- `build_module(spec)`: KernelSpec -> verified MLIR module (lowering.py,
  host.py, rules/)
- `check_tpu_rules(spec)`: TPU tiling / VMEM / SMEM rules (constraints.py)
- `to_mlir(f, *args)`, `to_modules(f, *args)`: the modules of the
  pallas_calls in `f` (mlir_modules.py)

Importing the package registers two backends with dsl: "mosaic" (launch.py:
the module in a `tpu_custom_call`, what a TPU runs) and "mosaic_interpret"
(interpret_launch.py: the module run on the host by
lowering_mosaic.verification.interpreter).
"""
from dsl.core import backends as _backends
from lowering_mosaic.tpu.constraints import check_tpu_rules
from lowering_mosaic.tpu.mlir_modules import dump_module, to_mlir, to_modules
from lowering_mosaic.tpu.interpret_launch import interpret_lowering
from lowering_mosaic.tpu.launch import mosaic_lowering
from lowering_mosaic.tpu.lowering import build_module, module_text
from lowering_mosaic.tpu.rules import TABLE

_backends.register_backend("mosaic", mosaic_lowering, rules=TABLE)
_backends.register_backend("mosaic_interpret", interpret_lowering,
                           rules=TABLE)

__all__ = ["TABLE", "build_module", "check_tpu_rules", "dump_module",
           "module_text", "to_mlir", "to_modules"]
