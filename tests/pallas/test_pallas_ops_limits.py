"""Every case of Pallas's kernel library that dsl does not check against
Pallas is either a limit Pallas shares or dsl's own gap, and these tests
hold which: the same case, unswapped, in Pallas's interpret mode (in the
context `benchmarks.pallas_library.cases` runs Pallas in) fails the way
`pallas_ops_swap.PALLAS_FAILS_TOO` says for the shared limits, and runs
and matches the op's reference for dsl's gaps (the XFAILs not in it).
Gradients compared with the reference only have no reverse mode in Pallas:
jax.vjp through Pallas's original raises. A Pallas release that lifts a
limit shows up here.
"""
from __future__ import annotations

import contextlib

import jax
import numpy as np
import pytest

from benchmarks.pallas_library import cases
from benchmarks.pallas_library.case import NO_PALLAS_GRAD, close
from tests.pallas import pallas_internals
from tests.pallas import pallas_ops_swap as swap


def _pallas(op):
  case = cases.make_case(op)
  try:
    out = jax.block_until_ready(cases.run_on_pallas(op, case))
    # A failed callback of the interpreter surfaces here, not later.
    jax.effects_barrier()
    return case, out
  finally:
    if swap.is_mgpu(op):
      # After a failure the other devices' tokens of the same run still
      # hold it: drain them (the failure is what the caller sees), and
      # reset Pallas's GPU interpret mode, as its docs ask.
      with contextlib.suppress(jax.errors.JaxRuntimeError):
        jax.effects_barrier()
      pallas_internals.reset_gpu_interpret_mode_state()


def _reference(op, case):
  return case.reference(swap.original(cases.module_of(op)), *case.args)


@pytest.mark.parametrize("op", sorted(swap.PALLAS_FAILS_TOO))
def test_pallas_fails_on_the_case_too(op):
  with pytest.raises(Exception, match=swap.PALLAS_FAILS_TOO[op]):
    _pallas(op)


_DSL_GAPS = sorted({op for op, _ in swap.XFAIL} - set(swap.PALLAS_FAILS_TOO))


def test_every_failing_case_is_a_limit_pallas_shares():
  """dsl runs every case of the library that Pallas's interpret mode runs:
  each strict xfail is a limit Pallas shares (held above). A gap of dsl's
  own would be listed here; it is then held to run on Pallas by
  `_pallas(op)` and `close(...)` against the op's reference, as before."""
  for op in _DSL_GAPS:
    case, got = _pallas(op)
    close(got, _reference(op, case), case.ref_tol or case.tol,
          f"{op} in Pallas's interpret mode vs its reference")
  assert not _DSL_GAPS, f"dsl's own gaps (Pallas runs them): {_DSL_GAPS}"


def test_pallas_all_gather_returns_nan():
  """tpu.all_gather is compared with its reference only: Pallas's TPU
  interpret mode leaves NaN in the gathered array (dsl's is exact)."""
  _, got = _pallas("tpu.all_gather")
  assert np.isnan(np.asarray(got)).any()


_NO_GRAD = sorted(c for c in [*cases.CASES, *cases.MATRIX]
                  if cases.no_pallas(c) == NO_PALLAS_GRAD)


@pytest.mark.parametrize("op", _NO_GRAD)
def test_pallas_has_no_reverse_mode_for_the_op(op):
  """Pallas cannot transpose pallas_call: at trace time its TPU ops raise
  NotImplementedError, its Triton ops fail an assertion of its partial
  evaluation or JAX's linearization ("Linearization failed")."""
  with pytest.raises((NotImplementedError, AssertionError, ValueError)):
    _pallas(op)


def test_every_case_compared_with_reference_only_is_covered():
  """Each NO_PALLAS reason is one of the above: a failure Pallas's
  interpret mode shows, NaN from it, or no reverse mode."""
  for op, why in swap.NO_PALLAS.items():
    assert (op in swap.PALLAS_FAILS_TOO or op == "tpu.all_gather"
            or why == NO_PALLAS_GRAD), op
  assert set(swap.PALLAS_FAILS_TOO) <= (
      {op for op, _ in swap.XFAIL} | set(swap.NO_PALLAS))
