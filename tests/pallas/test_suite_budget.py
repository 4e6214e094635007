"""The tests that tests/pallas/suite_budget.py leaves to `-m slow` exist,
and are marked slow when collected."""
import ast
import os

import pytest

from tests.pallas.suite_budget import SLOW

HERE = os.path.dirname(os.path.abspath(__file__))


def _test_functions(path: str) -> set[str]:
  with open(path) as fh:
    tree = ast.parse(fh.read())
  return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("nodeid", sorted(SLOW))
def test_every_listed_test_exists(nodeid):
  path, _, name = nodeid.partition("::")
  assert name.split("[")[0] in _test_functions(os.path.join(HERE, path))
  assert SLOW[nodeid]     # and says what covers it by default


def test_the_listed_tests_are_marked_slow(request):
  """Under the default `-m 'not gpu and not slow'` none of them is
  collected; under `-m slow` each one carries the mark."""
  listed = [i for i in request.session.items
            if i.nodeid.split("tests/pallas/", 1)[-1] in SLOW]
  if "not slow" in request.config.getoption("markexpr"):
    assert not listed
  assert all(i.get_closest_marker("slow") for i in listed)
