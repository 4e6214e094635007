"""Pallas's own kernel library runs on dsl by its import swap alone.

Each op of `jax.experimental.pallas.ops` (benchmarks/pallas_library/swap.py
serves it with `import dsl as pl`) runs one cheap shape on dsl's CPU
backends, chosen with `dsl.default_backend` (the ops name no backend), and
is compared with the original op in Pallas's interpret mode and with the
op's own reference where it has one. The default suite runs each op on one
backend (`pallas_ops_swap.default_backend`), the others under `-m slow`,
with the matrix of each op's other shapes, dtypes, optional features and
gradients. A case that fails today is a strict xfail whose reason is its
cause (`pallas_ops_swap.XFAIL`), so a fix shows up as an XPASS;
docs/pallas-compat.md lists the same table.
"""
from __future__ import annotations

import pytest

from benchmarks.pallas_library.cases import CASES, MATRIX, check
from tests.pallas import pallas_ops_page as page
from tests.pallas import pallas_ops_swap as swap


def _params():
  for op in [*CASES, *MATRIX]:
    for backend in swap.backends_of(op):
      slow = op in MATRIX or (op, backend) in swap.SLOW
      marks = [pytest.mark.slow] if slow else []
      cause = swap.XFAIL.get((op, backend))
      if cause is not None:
        marks.append(pytest.mark.xfail(strict=True, reason=cause))
      yield pytest.param(op, backend, marks=marks, id=f"{op}-{backend}")


@pytest.mark.parametrize("op,backend", list(_params()))
def test_op_on_dsl(op, backend):
  check(op, backend)


def test_the_table_lists_every_case():
  assert list(CASES) == list(swap.OPS)
  assert {swap.base_op(v) for v in MATRIX} <= set(swap.OPS)
  known = {(op, b) for op in [*CASES, *MATRIX] for b in swap.backends_of(op)}
  assert set(swap.XFAIL) <= known and swap.SLOW <= known
  assert set(swap.NO_PALLAS) <= set(swap.OPS)


def test_swapped_modules_run_on_dsl_not_pallas():
  for module, _ in [*CASES.values(), *MATRIX.values()]:
    swapped = swap.swapped(module)
    pallas_names = {name for name, value in vars(swapped).items()
                    if getattr(value, "__name__", "").startswith(
                        "jax.experimental.pallas")}
    assert not pallas_names, (module, pallas_names)


def test_rewrite_points_pallas_imports_at_dsl():
  source = ("from jax.experimental import pallas as pl\n"
            "import jax.experimental.pallas as pl2\n"
            "from jax.experimental.pallas import tpu as pltpu\n"
            "  from jax.experimental.pallas import triton as plgpu\n"
            "from jax.experimental.pallas import mosaic_gpu as plgpu\n"
            "import jax.experimental.pallas.mosaic_gpu as plgpu\n"
            "from jax.experimental.pallas.ops.tpu import matmul\n"
            "x = 1  # unchanged\n")
  assert swap.rewrite(source).splitlines() == [
      "import dsl as pl", "import dsl as pl2",
      "from dsl import tpu as pltpu", "  from dsl import triton as plgpu",
      "from dsl import mosaic_gpu as plgpu",
      "from dsl import mosaic_gpu as plgpu",
      f"from {swap.PREFIX}.tpu import matmul", "x = 1  # unchanged"]
  with pytest.raises(ImportError, match="fuser"):
    swap.rewrite("from jax.experimental.pallas import fuser\n")


def test_compat_page_lists_the_table():
  with open(page.COMPAT_PAGE, encoding="utf-8") as f:
    text = f.read()
  assert page.compat_section() in text, (
      "docs/pallas-compat.md is out of date: run "
      "`python -m tests.pallas.pallas_ops_page` to rewrite its section")
