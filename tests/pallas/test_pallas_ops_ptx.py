"""Pallas's GPU kernel library compiled for sm_90 by dsl and by Pallas from
the same source (tests/pallas/pallas_ops_ptx.py): each kernel of each op's
forward and backward, at realistic shapes, is no worse than Pallas's on
every criterion of `worse_than` (launch config and programs, wgmma and
async copies, barriers, the hot loops' selects, shared stores and global
loads, local memory, programs per SM). docs/performance.md lists the
figures.

A kernel still worse is a strict known failure, per Triton release (as
`KNOWN_BY_RELEASE` in test_perf_contracts.py), naming the cause: the test
fails once it is fixed, so the entry goes.
"""
import pytest

from tests.pallas import pallas_ops_ptx, perf_contracts
from tests.pallas.pallas_ops_ptx import CASES

KNOWN_BY_RELEASE: dict[str, dict[tuple[str, str], str]] = {}   # none today
KNOWN = KNOWN_BY_RELEASE.get(perf_contracts.triton_release(), {})


def _params():
  for name, case in CASES.items():
    for kernel in case.kernels:
      marks = [pytest.mark.slow] if case.slow else []
      if (name, kernel) in KNOWN:
        marks.append(pytest.mark.xfail(reason=KNOWN[(name, kernel)],
                                       strict=True))
      yield pytest.param(name, kernel, marks=marks, id=f"{name}-{kernel}")


@pytest.mark.parametrize("name,kernel", list(_params()))
def test_not_worse_than_pallas_on_the_same_source(name, kernel):
  found = pallas_ops_ptx.kernel_problems(name)
  assert list(found) == list(CASES[name].kernels)
  assert not found[kernel], f"{name}: {kernel}: " + "; ".join(found[kernel])


def test_every_known_failure_names_a_kernel_of_its_case():
  for table in KNOWN_BY_RELEASE.values():
    for name, kernel in table:
      assert kernel in CASES[name].kernels, (name, kernel)
