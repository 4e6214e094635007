"""docs/pallas-compat.md lists every public name of the installed Pallas and
says the truth about dsl having it."""
import importlib
import pathlib
import re
import types

import pytest

import dsl

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "pallas-compat.md"
MODULES = {
    "jax.experimental.pallas": "dsl",
    "jax.experimental.pallas.tpu": "dsl.tpu",
    "jax.experimental.pallas.triton": "dsl.triton",
    "jax.experimental.pallas.mosaic_gpu": "dsl.mosaic_gpu",
}
STATUSES = ("supported", "differs", "not supported")
_ROW = re.compile(r"^\| `([A-Za-z0-9_]+)` \| ([a-z ]+) \|(.*)\|$")


def public_names(module_name: str) -> set[str]:
  """The public names of `module_name`, with the submodules the page has a
  section for (they are attributes of the package once imported); other
  submodules (`ops`, which a benchmark may have imported in this process)
  are not part of the API the page lists."""
  for sub in MODULES:
    importlib.import_module(sub)
  module = importlib.import_module(module_name)
  names = {n for n in dir(module) if not n.startswith("_") and not (
      isinstance(getattr(module, n), types.ModuleType)
      and getattr(module, n).__name__.startswith(module_name + ".")
      and getattr(module, n).__name__ not in MODULES)}
  return names | deprecated_names(module)


def deprecated_names(module) -> set[str]:
  """Names the module still gives, with a deprecation warning, that `dir`
  no longer shows (JAX's `_deprecations` table; None marks a removed one)."""
  table = getattr(module, "_deprecations", {})
  return {n for n, (_, value) in table.items() if value is not None}


def page_tables() -> dict[str, dict[str, tuple[str, str]]]:
  """{module: {name: (status, note)}} from the page's tables, one per
  `## \\`module\\`` section."""
  tables, current = {}, None
  for line in PAGE.read_text().splitlines():
    head = re.match(r"^## `([a-z._]+)`", line)
    if head:
      current = tables.setdefault(head.group(1), {})
      continue
    row = _ROW.match(line)
    if row and current is not None:
      assert row.group(1) not in current, f"{row.group(1)} listed twice"
      current[row.group(1)] = (row.group(2).strip(), row.group(3).strip())
  return tables


@pytest.mark.parametrize("module_name", sorted(MODULES))
def test_page_lists_every_public_name(module_name):
  listed = page_tables().get(module_name, {})
  missing = sorted(public_names(module_name) - set(listed))
  assert not missing, (f"docs/pallas-compat.md does not list these names of "
                       f"{module_name}: {missing}")
  extra = sorted(set(listed) - public_names(module_name))
  assert not extra, f"listed but not in {module_name}: {extra}"


@pytest.mark.parametrize("module_name", sorted(MODULES))
def test_page_tells_the_truth(module_name):
  ours = importlib.import_module(MODULES[module_name])
  for name, (status, note) in page_tables()[module_name].items():
    assert status in STATUSES, f"{name}: unknown status {status!r}"
    if status == "not supported":
      assert not hasattr(ours, name), (
          f"{MODULES[module_name]}.{name} exists but the page says it is not "
          "supported")
      assert note, f"{name}: say why it is not supported and what to use"
    else:
      assert hasattr(ours, name), (
          f"the page says {MODULES[module_name]}.{name} is {status}, but it "
          "does not exist")
    if status == "differs":
      assert note, f"{name}: say how it differs"


def test_page_parses():
  tables = page_tables()
  assert set(tables) == set(MODULES)
  assert len(tables["jax.experimental.pallas"]) > 40
  assert dsl.Buffered.__name__ == "Buffered"
