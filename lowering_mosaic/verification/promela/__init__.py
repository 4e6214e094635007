"""Promela models of Mosaic kernels, and SPIN runs on them.

- `extract(module, num_devices)`: MLIR module -> `KernelModel` (model.py),
  walking the module with one rule per op (extract.py; the rules in
  views.py and ops_*.py, their table in mosaic_ir.py)
- `to_promela(module, num_devices)`: the model's Promela text (builder.py:
  the file and its processes; layout.py: where regions, cells and
  semaphores live; statements.py: one writer per statement type;
  prelude.pml: the inline macros every model shares)
- `maybe_dump(module, kernel_name, num_devices)`: writes the model to
  `jax_pallas_dump_promela_to` when that option is set (dump.py)
- `run_spin(text)` -> `Report`: `spin -a`, gcc, `pan` (spin.py), with the
  counterexample trail translated to kernel source lines (trail.py)
- error_table.py: the errors a model reports, their codes and their messages

See docs/verification.md.
"""
from lowering_mosaic.verification.promela.builder import (Options, build,
                                                          to_promela)
from lowering_mosaic.verification.promela.dump import maybe_dump, write_model
from lowering_mosaic.verification.promela.extract import ModelError, extract
from lowering_mosaic.verification.promela.spin_report import (KINDS, Report,
                                                         Reports, TrailStep)
from lowering_mosaic.verification.promela.spin import (INSTALL_HINT, SpinError,
                                                       SpinNotFoundError,
                                                       find_spin, run_spin,
                                                       spin_available)


__all__ = ["INSTALL_HINT", "KINDS", "ModelError", "Options", "Report",
           "Reports", "SpinError", "SpinNotFoundError", "TrailStep", "build",
           "extract", "find_spin", "maybe_dump", "run_spin", "spin_available",
           "to_promela", "write_model"]
