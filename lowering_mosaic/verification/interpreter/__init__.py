"""The Mosaic MLIR interpreter behind the `"mosaic_interpret"` backend.

- buffers.py: buffers and memref views
- value_ops.py: numpy meaning of arith/math/vector/tpu value ops
- program.py: compiles a module into closures; memory, DMA, semaphore and
  control-flow ops
- simulator.py: devices, DMA engines, semaphores, the scheduler and the
  race/deadlock checker
- run.py: the grid loop and block pipeline; `simulate`

Options (seed, race handling) are set with `interpreter_options(...)`, a
context manager that also keys JAX's jit cache, so a kernel is re-lowered
when they change.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading

from lowering_mosaic.verification.interpreter.simulator import (InterpreterOptions,
                                                                KernelDeadlockError,
                                                                KernelRaceError,
                                                                KernelSimulationError)
from dsl.core import config

_OPTIONS: dict[int, InterpreterOptions] = {0: InterpreterOptions()}
_IDS: dict[InterpreterOptions, int] = {InterpreterOptions(): 0}
_LOCK = threading.Lock()

_options_id = config.mosaic_interpret_options_id


def _set_options() -> InterpreterOptions:
  return _OPTIONS[int(_options_id.value)]


def current_options() -> InterpreterOptions:
  """The options set with `interpreter_options`, with `poison_buffers` and
  `runtime_checks` from JAX's jax_pallas_poison_buffers and
  jax_pallas_enable_runtime_assert as they are now (a kernel reads them
  when it is lowered, as Pallas does)."""
  return dataclasses.replace(
      _set_options(),
      poison_buffers=config.poison_buffers(),
      runtime_checks=config.enable_runtime_assert())


@contextlib.contextmanager
def interpreter_options(**changes):
  """Sets InterpreterOptions fields (seed=..., on_race="warn", ...) for the
  kernels lowered (and run) inside the block."""
  opts = dataclasses.replace(_set_options(), **changes)
  with _LOCK:
    oid = _IDS.get(opts)
    if oid is None:
      oid = len(_OPTIONS)
      _OPTIONS[oid] = opts
      _IDS[opts] = oid
  with _options_id(oid):
    yield opts


_REPORTS: list = []
_LAST_FAILURE: list = []


def reports() -> list:
  """Races recorded with on_race="warn" (most recent launches last)."""
  return list(_REPORTS)


def clear_reports():
  _REPORTS.clear()
  _LAST_FAILURE.clear()


def last_failure():
  """The KernelSimulationError of the last failed launch, or None."""
  return _LAST_FAILURE[-1] if _LAST_FAILURE else None


def note_failure(error: KernelSimulationError) -> None:
  """Keeps the failure of a launch for `last_failure`."""
  _LAST_FAILURE.append(error)


def note_reports(found: list) -> None:
  """Keeps the races a launch recorded for `reports`."""
  _REPORTS.extend(found)


__all__ = ["InterpreterOptions", "KernelDeadlockError", "KernelRaceError",
           "KernelSimulationError", "clear_reports", "current_options",
           "interpreter_options", "last_failure", "note_failure",
           "note_reports", "reports"]
