"""The Python blocks of README.md and docs/*.md that are marked runnable run.

A fenced ```python block runs when the line just before its fence is the
HTML comment `<!-- runnable -->`; `<!-- file: NAME.py -->` instead saves the
block as NAME.py (importable by the blocks after it). The blocks of one page
run in order, in one namespace, in a fresh directory (see
docs/architecture.md, "Docs").
"""
from __future__ import annotations

import contextlib
import glob
import io
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
PAGES = sorted([os.path.join(ROOT, "README.md")]
               + glob.glob(os.path.join(ROOT, "docs", "*.md")))
_BLOCK = re.compile(r"^<!-- (runnable|file: ([\w.]+)) -->\n```python\n(.*?)^```$",
                    re.M | re.S)


def marked_blocks(path: str) -> list[tuple[str | None, str, int]]:
  """(file name or None, code, line) of each marked block of a page."""
  with open(path) as fh:
    text = fh.read()
  return [(m.group(2), m.group(3), text.count("\n", 0, m.start()) + 3)
          for m in _BLOCK.finditer(text)]


def test_markers_are_well_formed():
  # A marker must sit right above a ```python fence, or it marks nothing.
  for path in PAGES:
    with open(path) as fh:
      text = fh.read()
    n_markers = len(re.findall(r"^<!-- (runnable|file: [\w.]+) -->$", text,
                               re.M))
    assert n_markers == len(marked_blocks(path)), path


RUNNABLE = [p for p in PAGES if marked_blocks(p)]


def test_the_pages_with_runnable_blocks():
  names = {os.path.relpath(p, ROOT) for p in RUNNABLE}
  assert {"README.md", "docs/mosaic.md", "docs/triton.md",
          "docs/verification.md", "docs/kernels.md"} <= names, names


@pytest.mark.parametrize("path", RUNNABLE,
                         ids=[os.path.relpath(p, ROOT) for p in RUNNABLE])
def test_runnable_blocks_run(path, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  monkeypatch.syspath_prepend(str(tmp_path))
  namespace = {"__name__": "__doc_page__"}
  saved = []
  try:
    for name, code, line in marked_blocks(path):
      if name:
        (tmp_path / name).write_text(code)
        saved.append(name[:-3])
        continue
      compiled = compile("\n" * (line - 1) + code, path, "exec")
      with contextlib.redirect_stdout(io.StringIO()):
        exec(compiled, namespace)   # noqa: S102 - the docs' own examples
  finally:
    for module in saved:
      sys.modules.pop(module, None)
