"""JAX's own Pallas test files, run on dsl by their import swap.

    python -m tests.pallas.pallas_suite [--jax-repo PATH] [--rev REV]
        [--files pallas_test.py ...] [-k EXPR] [--write-docs]

reads `tests/pallas/<file>` of a JAX checkout (or of a bare mirror, through
`git show`), rewrites its Pallas imports to dsl's (`import dsl as pl`,
`from dsl import tpu as pltpu`, ...) and its imports of Pallas's test
utilities to stand-ins of our own (`tests/pallas/pallas_suite_shims/`),
writes the result to a temporary folder, runs it with pytest and prints a
table per file (passed / failed / skipped / errors) and every failing test
with the first line of its error and, where the difference is known, why.
Nothing of JAX's test code is kept in this repository: the files are read
from the JAX repository at each run. Nothing else of a file changes, so
line numbers in tracebacks are the original's.

The tests' `interpret=True` is dsl's `interpret` backend; their classes for
a real TPU or GPU skip themselves on a CPU. `--write-docs` puts the table
into docs/pallas-compat.md ("Pallas's own tests on dsl"). The exit status is
1 when a test fails for a reason `KNOWN` does not list.

This module is not collected by pytest (no `test_` prefix);
tests/pallas/test_pallas_suite.py checks its rewrites and its report.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import fnmatch
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree

import jax

from tests.pallas import pallas_ops_swap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
DEFAULT_REPO = "/work/.mirror/jax-ml+jax/repo"
FILES = ("pallas_test.py", "ops_test.py", "indexing_test.py",
         "pallas_vmap_test.py")
COMPAT_PAGE = os.path.join(ROOT, "docs", "pallas-compat.md")
SECTION = "## Pallas's own tests on dsl"
COMMAND = "python -m tests.pallas.pallas_suite --write-docs"

_SHIMS = "tests.pallas.pallas_suite_shims"
# Pallas's (and JAX's) private test utilities -> our stand-ins, on every
# run (the installed JAX may lack them).
TEST_UTILS = {
    "jax._src.pallas.pallas_test_util": f"{_SHIMS}.pallas_test_util",
    "jax._src.hypothesis_test_util": f"{_SHIMS}.hypothesis_test_util",
}
# Pallas's private modules the files use -> what serves them on dsl.
PALLAS_PRIVATES = {
    "jax._src.pallas.primitives": f"{_SHIMS}.pallas_primitives",
}
# Pallas's public imports -> dsl's: those of the kernel library's swap and
# the Mosaic GPU module, which the test files import beside the others.
PALLAS_IMPORTS = pallas_ops_swap.PALLAS_IMPORTS + (
    (re.compile(r"^(\s*)from jax\.experimental\.pallas import mosaic_gpu "
                r"as (\w+)\s*$", re.M), r"\1from dsl import mosaic_gpu as \2"),
)
_FROM_IMPORT = re.compile(
    r"^(\s*)from (jax\._src(?:\.\w+)*) import (\w+) as (\w+)\s*$", re.M)
# A Pallas import left after the rewrites: the file would run part of
# itself on Pallas.
_LEFT_OVER = re.compile(
    r"^\s*(from|import)\s+(jax\.experimental\.pallas|jax\._src\.pallas)\b.*$",
    re.M)

_CONSTS = (
    "dsl runs a kernel body that closes over an array, where Pallas raises "
    "ValueError (\"captures constants ... pass them as inputs\"); see "
    "\"Kernels that run differently\"")
_PRIMITIVES = "ops_test.py::PallasPrimitivesInterpretTest::"
# Test ids (fnmatch patterns, "file::Class::test") that fail on dsl for a
# documented reason: the reason. docs/pallas-compat.md lists them.
KNOWN: dict[str, str] = {
    "pallas_test.py::PallasCallInterpretTest::test_const_args": _CONSTS,
    "pallas_vmap_test.py::PallasCallVmapInterpretTest::"
    "test_vmap_with_const_args": _CONSTS,
    "pallas_test.py::ApiErrorInterpretTest::"
    "test_pallas_call_index_map_captures_consts":
        "dsl runs an index map that closes over an array on the host and "
        "Triton backends, where Pallas raises ValueError (\"must not capture "
        "constants\"); the Mosaic backends reject it; see \"Kernels that run "
        "differently\"",
    "pallas_test.py::ApiErrorInterpretTest::"
    "test_pallas_call_in_specs_mismatch_inputs":
        "dsl reads `in_specs` with one BlockSpec per array of the inputs as a "
        "flat list even where the inputs nest (here `[spec, spec]` for `(a, "
        "{'a': a})`), so the specs match and the error (a ValueError, as "
        "Pallas's) is the kernel's arity: `<lambda>() takes 2 positional "
        "arguments but 3 were given`",
    "pallas_test.py::ApiErrorInterpretTest::test_pallas_error_for_ref_to_jax":
        "the same ValueError and JAX message, but a block ref of dsl's "
        "`interpret` backend has no memory space, so it prints as "
        "`Ref{float32[8,32]}`, not `Ref<default>{float32[8,32]}`",
    _PRIMITIVES + "test_swap_pretty_print[01]":
        "dsl has no swap primitive: the stand-in for Pallas's private "
        "`primitives.swap` is a masked load and a masked store, which print "
        "as two equations (the values are Pallas's: `test_swap`, "
        "`test_masked_swap` and `test_masked_oob_swap_slice` pass)",
    _PRIMITIVES + "test_*_pretty_print[234]":
        "fails on the installed Pallas too (`--on pallas`): the installed "
        "JAX's indexer rejects a static slice past the end of the ref "
        "(\"Out of bound slice\"), which the test files' JAX release took",
}


def rewrite(source: str, origin: str = "<source>", on: str = "dsl") -> str:
  """`source` of a JAX test file with its Pallas imports pointed at dsl and
  its imports of Pallas's test utilities at our stand-ins; `on="pallas"`
  rewrites the test utilities only (the baseline: Pallas itself)."""
  if on == "dsl":
    for pattern, replacement in PALLAS_IMPORTS:
      source = pattern.sub(replacement, source)

  served_by = {**TEST_UTILS, **(PALLAS_PRIVATES if on == "dsl" else {})}

  def private(match):
    indent, package, name, alias = match.groups()
    served = served_by.get(f"{package}.{name}")
    if served is None:
      return match.group(0)
    parent, _, leaf = served.rpartition(".")
    return f"{indent}from {parent} import {leaf} as {alias}"

  source = _FROM_IMPORT.sub(private, source)
  left = _LEFT_OVER.search(source)
  if left is not None and on == "dsl":
    raise ImportError(f"{origin}: a Pallas import the harness does not "
                      f"rewrite: {left.group(0).strip()!r}")
  return source


def _is_bare(repo: str) -> bool:
  return not os.path.isdir(os.path.join(repo, "tests", "pallas"))


def read_file(repo: str, path: str, rev: str = "HEAD") -> str:
  """The text of `path` in the JAX repository `repo`: from its work tree,
  or at `rev` through `git show` when it has none."""
  if not _is_bare(repo):
    with open(os.path.join(repo, path), encoding="utf-8") as f:
      return f.read()
  return subprocess.run(["git", "-C", repo, "show", f"{rev}:{path}"],
                        check=True, capture_output=True, text=True).stdout


def source_release(repo: str, rev: str = "HEAD") -> str:
  """The JAX version and commit the test files come from."""
  found = re.search(r'^_version\s*=\s*"([^"]+)"',
                    read_file(repo, "jax/version.py", rev), re.M)
  version = found.group(1) if found else "?"
  commit = subprocess.run(
      ["git", "-C", repo, "rev-parse", "--short=12", rev if _is_bare(repo)
       else "HEAD"], capture_output=True, text=True).stdout.strip() or "?"
  return f"{version} (commit {commit})"


# The conftest.py of the folder the files run in.
CONFTEST = f"""from {_SHIMS} import jax_options
jax_options.install()
"""


def extract(repo: str, folder: str, files=FILES, rev: str = "HEAD",
            on: str = "dsl") -> None:
  """Writes the rewritten test `files` of `repo` into `folder`, with a
  conftest.py that gives JAX's config the options the files read."""
  with open(os.path.join(folder, "conftest.py"), "w", encoding="utf-8") as f:
    f.write(CONFTEST)
  for name in files:
    path = f"tests/pallas/{name}"
    with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
      f.write(rewrite(read_file(repo, path, rev), path, on))


@dataclasses.dataclass(frozen=True)
class Result:
  file: str            # "pallas_test.py"
  test_id: str         # "pallas_test.py::Class::test_name"
  outcome: str         # "passed", "failed", "skipped", "error"
  message: str = ""    # the first line of the error or the skip reason


def _first_line(text: str | None) -> str:
  for line in (text or "").splitlines():
    if line.strip():
      return line.strip()[:240]
  return ""


def _error_line(element) -> str:
  """The first line of an error's message; for a failure to import a file
  (whose message says only that), the exception pytest reports."""
  message = element.get("message") or ""
  if message == "collection failure":
    raised = [line[1:].strip() for line in (element.text or "").splitlines()
              if line.startswith("E ")]
    return _first_line(raised[-1] if raised else message)
  return _first_line(message or element.text)


def parse_junit(path: str) -> list[Result]:
  """The results a pytest `--junitxml` report at `path` holds."""
  results = []
  for case in ElementTree.parse(path).getroot().iter("testcase"):
    module, _, cls = case.get("classname", "").partition(".")
    name = case.get("name", "")
    if not module:      # a file that failed to import
      module, name = name or "?", ""
    file = f"{module}.py"
    test_id = "::".join(p for p in (file, cls, name) if p)
    outcome, message = "passed", ""
    for tag, name in (("failure", "failed"), ("error", "error"),
                      ("skipped", "skipped")):
      found = case.find(tag)
      if found is not None:
        outcome = name
        message = _error_line(found)
        break
    results.append(Result(file, test_id, outcome, message))
  return results


def run(repo: str, files=FILES, rev: str = "HEAD", pytest_args=("--tb=no",),
        on: str = "dsl") -> list[Result]:
  """Extracts `files` of `repo`, runs them with pytest on dsl (or on Pallas,
  `on="pallas"`), and returns their results."""
  with tempfile.TemporaryDirectory(prefix="dsl-pallas-suite-") as folder:
    extract(repo, folder, files, rev, on)
    report = os.path.join(folder, "report.xml")
    env = dict(os.environ, JAX_PLATFORMS="cpu", DSL_PALLAS_SUITE_ON=on,
               PYTHONPATH=os.pathsep.join(
        [ROOT, folder, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "--continue-on-collection-errors", "--rootdir", folder, "-c", os.devnull, f"--junitxml={report}",
         *pytest_args, *(os.path.join(folder, f) for f in files)],
        cwd=folder, env=env, check=False)
    if not os.path.exists(report):
      raise RuntimeError("pytest wrote no report; see its output above")
    return parse_junit(report)


def known_reason(test_id: str) -> str | None:
  """Why test `test_id` fails on dsl, when the difference is documented."""
  for pattern, reason in KNOWN.items():
    if fnmatch.fnmatchcase(test_id, pattern):
      return reason
  return None


_OUTCOMES = ("passed", "failed", "skipped", "error")


def counts(results: list[Result], files=FILES) -> dict[str, dict[str, int]]:
  """file -> outcome -> number of tests, with a "total" row."""
  table = {f: dict.fromkeys(_OUTCOMES, 0) for f in files}
  table["total"] = dict.fromkeys(_OUTCOMES, 0)
  for r in results:
    table.setdefault(r.file, dict.fromkeys(_OUTCOMES, 0))[r.outcome] += 1
    table["total"][r.outcome] += 1
  return table


def failures(results: list[Result]) -> list[Result]:
  return [r for r in results if r.outcome in ("failed", "error")]


def report_text(results: list[Result], files=FILES) -> str:
  """The per-file table and the failing tests, as plain text."""
  lines = [f"{'file':<24}" + "".join(f"{o:>9}" for o in _OUTCOMES)]
  for file, row in counts(results, files).items():
    lines.append(f"{file:<24}" + "".join(f"{row[o]:>9}" for o in _OUTCOMES))
  for r in failures(results):
    reason = known_reason(r.test_id)
    lines.append(f"{r.outcome.upper()} {r.test_id}: {r.message}")
    lines.append(f"    {'known: ' + reason if reason else 'UNEXPLAINED'}")
  return "\n".join(lines)


def docs_section(results: list[Result], release: str, files=FILES) -> str:
  """The section of docs/pallas-compat.md with the table of a run."""
  today = datetime.date.today().isoformat()
  lines = [
      SECTION, "",
      "JAX's own Pallas tests (`tests/pallas/` of JAX's repository: "
      + ", ".join(f"`{f}`" for f in files) + ") run on dsl by their import "
      "swap: `tests/pallas/pallas_suite.py` reads each file from a JAX "
      "checkout or mirror (`--jax-repo`), points its Pallas imports at dsl "
      "and its imports of Pallas's test utilities "
      "(`jax._src.pallas.pallas_test_util`, `jax._src.hypothesis_test_util`) "
      "and of Pallas's private `jax._src.pallas.primitives` (`load`, `store`, "
      "`swap`) at stand-ins of ours (`tests/pallas/pallas_suite_shims/`), "
      "and runs it with pytest in a temporary folder; nothing of JAX's test "
      "code is kept here. The tests' `interpret=True` runs dsl's `interpret` "
      "backend; their TPU and GPU classes skip themselves on a CPU. `--on "
      "pallas` runs the same files on the installed Pallas instead (a "
      "baseline), `-k` selects tests as pytest's. A whole run takes about "
      "20 minutes on two CPU cores, most of it in `ops_test.py`.", "",
      f"Run on {today}, test files of JAX {release}, installed jax "
      f"{jax.__version__}:", "", "```", COMMAND, "```", "",
      "| file | passed | failed | skipped | errors |", "|---|---|---|---|---|"]
  for file, row in counts(results, files).items():
    name = f"`{file}`" if file != "total" else "total"
    lines.append(f"| {name} | " + " | ".join(
        str(row[o]) for o in _OUTCOMES) + " |")
  bad = failures(results)
  if bad:
    lines += ["", "The tests that fail, and why:", ""]
    lines += [f"- `{r.test_id}`: {known_reason(r.test_id) or r.message}"
              for r in bad]
  return "\n".join(lines) + "\n"


def write_docs(section: str, path: str = COMPAT_PAGE) -> None:
  """Rewrites (or adds, before the kernel library's) the section."""
  with open(path, encoding="utf-8") as f:
    page = f.read()
  start = page.find(SECTION + "\n")
  if start < 0:
    anchor = page.find("\n" + pallas_ops_swap.SECTION + "\n")
    start = end = len(page) if anchor < 0 else anchor + 1
    section += "\n"
  else:
    end = page.find("\n## ", start + len(SECTION))
    end = len(page) if end < 0 else end + 1
    section += "\n" if end < len(page) else ""
  with open(path, "w", encoding="utf-8") as f:
    f.write(page[:start] + section + page[end:])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--jax-repo", default=DEFAULT_REPO,
                      help="a JAX checkout or (bare) mirror")
  parser.add_argument("--rev", default="HEAD",
                      help="the commit to read from a bare mirror")
  parser.add_argument("--files", nargs="+", default=list(FILES))
  parser.add_argument("-k", dest="keyword", help="pytest's -k expression")
  parser.add_argument("--tb", default="no",
                      help="pytest's traceback style for failures")
  parser.add_argument("--on", choices=("dsl", "pallas"), default="dsl",
                      help="run the files on dsl, or unchanged on the "
                      "installed Pallas (a baseline)")
  parser.add_argument("--write-docs", action="store_true",
                      help="write the table into docs/pallas-compat.md")
  args = parser.parse_args(argv)
  extra = (f"--tb={args.tb}",) + (("-k", args.keyword) if args.keyword
                                  else ())
  results = run(args.jax_repo, args.files, args.rev, extra, args.on)
  print(report_text(results, args.files))
  if args.write_docs:
    write_docs(docs_section(results, source_release(args.jax_repo, args.rev),
                            args.files))
  return 1 if any(known_reason(r.test_id) is None
                  for r in failures(results)) else 0


if __name__ == "__main__":
  sys.exit(main())
