"""Pallas's TPU ops lower to Pallas's own Mosaic modules on dsl.

Each swapped TPU op of test_pallas_ops.py (its one cheap shape) is lowered
for a TPU (on the CPU) through dsl and, unswapped, through Pallas; the
`tpu_custom_call`s are compared with the golden helper (mosaic_golden.py:
the decoded, canonicalized modules, the calls' configs and attributes;
locations are left to test_mosaic_golden.py). A difference not fixed yet is
a strict xfail naming it, so a fix shows up as an XPASS.
"""
from __future__ import annotations

import pytest

from tests.pallas import mosaic_golden as golden
from tests.pallas import pallas_ops_swap as swap
from benchmarks.pallas_library import cases as ops

TPU_OPS = [op for op in ops.CASES
           if op.startswith("tpu.") and not op.endswith("(grad)")]

# op -> why dsl's module or call is not Pallas's yet.
DIFFERS: dict[str, str] = {}


def _params():
  for op in TPU_OPS:
    marks = []
    if op in DIFFERS:
      marks.append(pytest.mark.xfail(strict=True, reason=DIFFERS[op]))
    yield pytest.param(op, marks=marks, id=op)


def _lower(op, module):
  case = ops.CASES[op][1]()
  return golden.lower_tpu(lambda *a: case.run(module, False, *a), *case.args)


@pytest.mark.parametrize("op", list(_params()))
def test_op_lowers_to_pallas_module(op):
  name = ops.CASES[op][0]
  theirs = _lower(op, swap.original(name))
  assert theirs, "Pallas emitted no tpu_custom_call"
  ours = _lower(op, swap.swapped(name))
  assert len(ours) == len(theirs), (len(ours), len(theirs))
  for a, b in zip(ours, theirs):
    assert a.module == b.module, golden.diff(a.module, b.module)
    assert a.config == b.config
    assert a.attrs == b.attrs
