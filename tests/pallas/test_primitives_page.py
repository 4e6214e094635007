"""docs/primitives.md is generated from the backends' rule tables
(`python -m dsl.tools.primitives_page`) and must match them."""
from jax import lax

from dsl.core import backends
from dsl.tools import primitives_page
from tests.pallas import testing


def test_the_page_matches_the_rule_tables():
  with open(primitives_page.PAGE) as fh:
    page = fh.read()
  assert page == primitives_page.make_page(), (
      "docs/primitives.md is stale: run python -m dsl.tools.primitives_page")
  assert primitives_page.main(["--check"]) == 0


def test_a_rule_added_without_regenerating_the_page_fails(monkeypatch):
  table = backends.rule_table("mosaic_gpu")
  assert testing.no_rule_p not in table
  before = primitives_page.make_page()
  assert "no_rule_for_tests" not in before
  monkeypatch.setitem(table._by_key, testing.no_rule_p, lambda ctx, x: x)
  after = primitives_page.make_page()
  assert "| `no_rule_for_tests` | runs |  |  | rule |" in after
  assert primitives_page.main(["--check"]) == 1


def test_every_backend_is_a_column_and_every_rule_a_row():
  page = primitives_page.make_page()
  header = next(l for l in page.splitlines() if l.startswith("| primitive"))
  for name in backends.BACKENDS:
    assert f"`{name}`" in header
  for name in ("triton", "mosaic", "mosaic_gpu"):
    for prim in backends.rule_table(name).names():
      assert f"| `{prim}` |" in page
