"""docs/architecture.md names real places: every repository path and every
dotted name of the library it mentions (in backquotes) exists."""
import importlib
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
PAGE = os.path.join(ROOT, "docs", "architecture.md")
PACKAGES = ("dsl", "lowering_triton", "lowering_mosaic", "kernels",
            "benchmarks", "tests")
_CODE = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"^(?:%s)/[\w/.]*$" % "|".join(PACKAGES))
_DOTTED = re.compile(r"^(?:%s)(?:\.\w+)+$" % "|".join(PACKAGES))


def _spans():
  with open(PAGE, encoding="utf-8") as f:
    return [m.group(1).strip() for m in _CODE.finditer(f.read())]


def _resolves(dotted: str) -> bool:
  """Whether `a.b.c` is a module, or an attribute of the longest module
  prefix that imports."""
  parts = dotted.split(".")
  for n in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:n]))
    except ImportError:
      continue
    for attr in parts[n:]:
      if not hasattr(obj, attr):
        return False
      obj = getattr(obj, attr)
    return True
  return False


def test_paths_the_page_names_exist():
  paths = [s for s in _spans() if _PATH.match(s)]
  assert len(paths) > 20
  missing = [p for p in paths if not os.path.exists(os.path.join(ROOT, p))]
  assert not missing, missing


def test_dotted_names_the_page_names_exist():
  names = {s.split("(")[0] for s in _spans()
           if _DOTTED.match(s.split("(")[0])}
  assert len(names) > 10
  missing = sorted(n for n in names if not _resolves(n))
  assert not missing, missing
