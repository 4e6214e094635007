"""Who imports whom, across the repository: the library, benchmarks and
scripts import no tests; helpers shared by tests live in helper modules, so
a test module imports another test module only to run its test functions
again (the re-runs listed here)."""
import ast
import glob
import os

from dsl.core import jax_internals

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

# test module -> the test modules whose test functions it runs again.
RERUNS = {
    "test_triton_features": {"test_features"},     # compiled for sm_90
    "test_triton_gpu": {"test_features", "test_triton_ops"},   # on a GPU
    "test_mosaic_gpu": {"test_features"},          # built for Mosaic GPU
    "test_mosaic_gpu_device": {"test_features"},   # on a Hopper GPU
}


def _imported(path: str) -> set[str]:
  """Every module `path` imports (`from a import b` gives a and a.b)."""
  with open(path) as f:
    tree = ast.parse(f.read())
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{a.name}" for a in node.names)
  return names


def _files(*patterns):
  for pattern in patterns:
    yield from sorted(glob.glob(os.path.join(_ROOT, pattern), recursive=True))


def test_library_benchmarks_and_scripts_import_no_tests():
  found = [(os.path.relpath(p, _ROOT), m) for p in _files(
      "dsl/**/*.py", "lowering_*/**/*.py", "kernels/**/*.py",
      "benchmarks/**/*.py", "scripts/**/*.py", "examples/**/*.py")
           for m in _imported(p) if m == "tests" or m.startswith("tests.")]
  assert not found, found


def _dotted(path: str) -> str:
  return os.path.relpath(path, _ROOT)[:-3].replace(os.sep, ".")


def test_test_modules_import_other_test_modules_only_to_run_them_again():
  test_modules = {_dotted(p) for p in _files("tests/**/test_*.py")}
  found = []
  for path in _files("tests/**/*.py"):
    name = os.path.basename(path)[:-3]
    # `from tests.pallas.test_x import f` imports tests.pallas.test_x too.
    tests = {m.rsplit(".", 1)[1] for m in _imported(path)
             if m in test_modules}
    extra = tests - RERUNS.get(name, set()) - {name}
    if extra:
      found.append((os.path.relpath(path, _ROOT), sorted(extra)))
  assert not found, found


def test_jax_internals_come_through_one_module():
  """Every `jax._src` name the repository uses is imported by
  dsl/core/jax_internals.py alone, where release differences live."""
  found = [(os.path.relpath(p, _ROOT), m) for p in _files(
      "dsl/**/*.py", "lowering_*/**/*.py", "kernels/**/*.py",
      "benchmarks/**/*.py", "scripts/**/*.py", "examples/**/*.py",
      "tests/**/*.py")
           if not p.endswith(os.path.join("dsl", "core", "jax_internals.py"))
           for m in _imported(p)
           if (m == "jax._src" or m.startswith("jax._src."))
           and not _pallas_internals_in_tests(p, m)]
  assert not found, found


def _pallas_internals_in_tests(path: str, module: str) -> bool:
  """Pallas's private modules, which only the tests reach (through
  tests/pallas/pallas_internals.py), never the library."""
  return (path.endswith(os.path.join("tests", "pallas", "pallas_internals.py"))
          and module.startswith("jax._src.pallas"))


def test_jax_internals_names_resolve():
  missing = []
  for name in jax_internals._TABLE:
    try:
      getattr(jax_internals, name)
    except (AttributeError, ImportError) as e:
      missing.append((name, str(e)))
  assert not missing, missing
