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
          "docs/verification.md", "docs/kernels.md", "docs/autotune.md",
          "docs/profiling.md", "docs/transformations.md"} <= names, names


@pytest.mark.parametrize("path", RUNNABLE,
                         ids=[os.path.relpath(p, ROOT) for p in RUNNABLE])
def test_runnable_blocks_run(path, tmp_path, monkeypatch):
  if path.endswith("verification.md"):
    from lowering_mosaic.verification import promela
    ok, why = promela.spin_available()
    if not ok:
      pytest.skip(why)
  monkeypatch.chdir(tmp_path)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setenv("DSL_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
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


def test_quickstart_runs_the_readme_lines():
  # The README says examples/quickstart.py runs its example: the model, its
  # gradient and a vmap of the kernel, each checked against jnp.
  import runpy
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    runpy.run_path(os.path.join(ROOT, "examples", "quickstart.py"),
                   run_name="__main__")
  text = out.getvalue()
  assert "grad:" in text and "vmap: (2, 10000), matches jnp" in text, text
  with open(os.path.join(ROOT, "README.md")) as fh:
    readme = fh.read()
  for line in ("jax.grad(model)(x, y)", "jax.vmap(add)("):
    assert line in readme
    with open(os.path.join(ROOT, "examples", "quickstart.py")) as fh:
      assert line in fh.read(), line


def _verification_example():
  blocks = marked_blocks(os.path.join(ROOT, "docs", "verification.md"))
  return next(code for name, code, _ in blocks if name == "ring.py")


def _documented_output(command: str) -> list[str]:
  """The output block shown after `command` in docs/verification.md."""
  with open(os.path.join(ROOT, "docs", "verification.md")) as fh:
    text = fh.read()
  at = text.index(f"```bash\n{command}\n```")
  m = re.compile(r"```\n(.*?)```", re.S).search(text, at + len(command) + 12)
  return m.group(1).splitlines()


def _without_times(line: str) -> str:
  return re.sub(r"search [\d.]+ s, total [\d.]+ s", "search - s, total - s",
                line)


@pytest.mark.parametrize("fn,code", [("ring_shift", 0),
                                     ("ring_shift_broken", 1)])
def test_verification_example_output_is_real(fn, code, tmp_path, monkeypatch,
                                             capsys):
  from lowering_mosaic.verification import promela
  import lowering_mosaic.verify as verify
  ok, why = promela.spin_available()
  if not ok:
    pytest.skip(why)
  (tmp_path / "ring.py").write_text(_verification_example())
  monkeypatch.chdir(tmp_path)
  try:
    assert verify.main([f"ring.py:{fn}", "f32[32,128]"]) == code
  finally:
    sys.modules.pop("_verify_target", None)
  got = capsys.readouterr().out.splitlines()
  shown = _documented_output(
      f"python -m lowering_mosaic.verify ring.py:{fn} f32[32,128]")
  assert [_without_times(l) for l in got] == [_without_times(l) for l in shown]
