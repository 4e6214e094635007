"""Pallas's TPU ops lower to Pallas's own Mosaic modules on dsl.

Every TPU case of test_pallas_ops.py (each op's cheap shape and each variant
of its matrix: segment ids, causal and other masks, soft caps, sliding
windows, quantized KV caches, megacore modes, ...; gradients through the
op's own custom_vjp backward kernels) is lowered for a TPU (on the CPU)
through dsl and, unswapped, through Pallas; every `tpu_custom_call` it
emits is compared with the golden helper (mosaic_golden.py: the decoded,
canonicalized modules, the calls' configs and attributes; locations are
left to test_mosaic_golden.py). A difference is a strict xfail naming its
cause (`pallas_ops_swap.GOLDEN_DIFFERS`), so a fix shows up as an XPASS.
The variants that lower slowly run under `-m slow` (`GOLDEN_SLOW`).

Gradients through dsl's automatic reverse mode have no Pallas module to
compare with: Pallas has no reverse mode through pallas_call.
"""
from __future__ import annotations

import pytest

from tests.pallas import mosaic_golden as golden
from tests.pallas import pallas_ops_swap as swap
from benchmarks.pallas_library import cases as ops
from benchmarks.pallas_library.case import NO_PALLAS_GRAD

GOLDEN = ops.golden_cases()


def _params():
  for op in GOLDEN:
    marks = []
    if op in swap.GOLDEN_SLOW:
      marks.append(pytest.mark.slow)
    if op in swap.GOLDEN_DIFFERS:
      marks.append(pytest.mark.xfail(strict=True,
                                     reason=swap.GOLDEN_DIFFERS[op]))
    yield pytest.param(op, marks=marks, id=op)


def _lower(op, module):
  case = ops.make_case(op)
  return golden.lower_tpu(lambda *a: case.run(module, False, *a), *case.args)


@pytest.mark.parametrize("op", list(_params()))
def test_op_lowers_to_pallas_module(op):
  name = ops.module_of(op)
  theirs = _lower(op, swap.original(name))
  assert theirs, "Pallas emitted no tpu_custom_call"
  ours = _lower(op, swap.swapped(name))
  assert len(ours) == len(theirs), (len(ours), len(theirs))
  for k, (a, b) in enumerate(zip(ours, theirs)):
    assert a.module == b.module, f"call {k}:\n{golden.diff(a.module, b.module)}"
    assert a.config == b.config, f"call {k}"
    assert a.attrs == b.attrs, f"call {k}"


def test_the_status_names_golden_cases():
  assert set(swap.GOLDEN_DIFFERS) <= set(GOLDEN)
  assert swap.GOLDEN_SLOW <= set(GOLDEN) - set(ops.CASES)
  # The custom_vjp backward kernels are compared too.
  assert {"tpu.flash_attention [grad, causal]",
          "tpu.splash_attention [grad, fused backward kernel]",
          "tpu.megablox.gmm (grad)"} <= set(GOLDEN)


@pytest.mark.parametrize("op", [c for c in [*ops.CASES, *ops.MATRIX]
                                if c.startswith("tpu.") and c not in GOLDEN])
def test_pallas_lowers_no_module_for_the_cases_left_out(op):
  """The TPU cases left out above (gradients through dsl's automatic
  reverse mode): Pallas's own lowering cannot lower them."""
  assert ops.no_pallas(op) == NO_PALLAS_GRAD
  with pytest.raises((NotImplementedError, AssertionError, ValueError)):
    _lower(op, swap.original(ops.module_of(op)))
