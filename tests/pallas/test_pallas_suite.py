"""The harness that runs JAX's own Pallas test files on dsl
(tests/pallas/pallas_suite.py): its import rewrites, its reading of
pytest's report, the section of docs/pallas-compat.md it writes, and (slow,
where a JAX mirror is on the machine) a run of one file."""
import os
import re

import pytest

from tests.pallas import pallas_suite as suite

_SOURCE = """\
import jax
from jax._src import hypothesis_test_util as htu
from jax._src.pallas import pallas_test_util as ptu
from jax._src.pallas import primitives as pallas_primitives
from jax.experimental import pallas as pl
if True:
  from jax.experimental.pallas import tpu as pltpu
  from jax.experimental.pallas import mosaic_gpu as plmgpu
x = pl.pallas_call
"""


def test_rewrite_points_pallas_imports_at_dsl_line_for_line():
  out = suite.rewrite(_SOURCE)
  assert out.splitlines() == [
      "import jax",
      "from tests.pallas.pallas_suite_shims import hypothesis_test_util "
      "as htu",
      "from tests.pallas.pallas_suite_shims import pallas_test_util as ptu",
      "from tests.pallas.pallas_suite_shims import pallas_primitives as "
      "pallas_primitives",
      "import dsl as pl",
      "if True:",
      "  from dsl import tpu as pltpu",
      "  from dsl import mosaic_gpu as plmgpu",
      "x = pl.pallas_call",
  ]


def test_rewrite_on_pallas_changes_the_test_utilities_only():
  out = suite.rewrite(_SOURCE, on="pallas").splitlines()
  original = _SOURCE.splitlines()
  changed = [i for i, (a, b) in enumerate(zip(original, out)) if a != b]
  assert changed == [1, 2]
  assert "from jax._src.pallas import primitives as pallas_primitives" in out


def test_rewrite_refuses_a_pallas_import_it_cannot_serve():
  with pytest.raises(ImportError, match="pallas.mosaic import lowering"):
    suite.rewrite("from jax._src.pallas.mosaic import lowering as lw\n",
                  "f.py")


_REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="a_test.OneTest" name="test_ok" time="0.1"/>
<testcase classname="a_test.OneTest" name="test_bad" time="0.1">
  <failure message="AssertionError: 1 != 2&#10;second line">trace</failure>
</testcase>
<testcase classname="a_test.OneTest" name="test_skip" time="0">
  <skipped type="pytest.skip" message="needs a TPU">skip</skipped>
</testcase>
<testcase classname="" name="b_test" time="0">
  <error message="collection failure">Traceback
E   ImportError: no module
E   AttributeError: no attribute 'x'</error>
</testcase>
</testsuite></testsuites>
"""


def test_results_come_from_pytests_report(tmp_path):
  path = tmp_path / "report.xml"
  path.write_text(_REPORT)
  results = suite.parse_junit(str(path))
  assert [(r.test_id, r.outcome, r.message) for r in results] == [
      ("a_test.py::OneTest::test_ok", "passed", ""),
      ("a_test.py::OneTest::test_bad", "failed", "AssertionError: 1 != 2"),
      ("a_test.py::OneTest::test_skip", "skipped", "needs a TPU"),
      ("b_test.py", "error", "AttributeError: no attribute 'x'"),
  ]
  table = suite.counts(results, ("a_test.py", "b_test.py"))
  assert table["a_test.py"] == dict(passed=1, failed=1, skipped=1, error=0)
  assert table["total"] == dict(passed=1, failed=1, skipped=1, error=1)
  text = suite.report_text(results, ("a_test.py", "b_test.py"))
  assert "FAILED a_test.py::OneTest::test_bad: AssertionError: 1 != 2" in text
  assert text.count("UNEXPLAINED") == 2


def test_known_failures_are_matched_by_pattern():
  assert "Out of bound slice" in suite.known_reason(
      "ops_test.py::PallasPrimitivesInterpretTest::test_store_pretty_print3")
  assert suite.known_reason(
      "ops_test.py::PallasPrimitivesInterpretTest::test_store_pretty_print0"
  ) is None


def _compat_section() -> str:
  with open(suite.COMPAT_PAGE, encoding="utf-8") as f:
    page = f.read()
  start = page.index(suite.SECTION + "\n")
  end = page.find("\n## ", start + 1)
  return page[start:end if end >= 0 else len(page)]


def test_compat_page_gives_a_reason_for_every_failing_test():
  section = _compat_section()
  assert suite.COMMAND in section
  listed = re.findall(r"^- `([^`]+)`: (.*)$", section, re.M)
  assert listed
  for test_id, reason in listed:
    assert suite.known_reason(test_id) == reason, test_id
  total = re.search(r"^\| total \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|$",
                    section, re.M)
  assert int(total.group(2)) + int(total.group(4)) == len(listed)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(suite.DEFAULT_REPO),
                    reason="no JAX mirror on this machine")
def test_vmap_file_runs_on_dsl_with_known_failures_only():
  results = suite.run(suite.DEFAULT_REPO, ("pallas_vmap_test.py",))
  table = suite.counts(results, ("pallas_vmap_test.py",))
  assert table["pallas_vmap_test.py"]["passed"] >= 10
  assert all(suite.known_reason(r.test_id) for r in suite.failures(results))
