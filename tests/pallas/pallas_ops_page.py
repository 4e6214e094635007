"""The section of docs/pallas-compat.md that lists Pallas's kernel library on
dsl: each op (benchmarks.pallas_library.cases.CASES) on each dsl CPU backend, its matrix of
variants (MATRIX, under `-m slow`), what fails and why (pallas_ops_swap),
and, on `interpret`, its speed beside Pallas's interpret mode from the
committed record of `python -m benchmarks --suite pallas-ops`.

    python -m tests.pallas.pallas_ops_page     # rewrites the section
"""
from __future__ import annotations

import os

from benchmarks import pallas_ops as speed
from tests.pallas import pallas_ops_swap as swap
from benchmarks.pallas_library.cases import MATRIX, golden_cases, no_pallas

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
COMPAT_PAGE = os.path.join(_ROOT, "docs", "pallas-compat.md")
# The record the `vs Pallas` column comes from.
SPEED_RECORD = os.path.join(_ROOT, "benchmarks", "results",
                            "pallas-ops-cpu.json")
_SECTION = swap.SECTION

_INTRO = (
    "Pallas's own kernel library (`jax.experimental.pallas.ops` in the "
    "installed JAX) runs on dsl by its import swap alone: "
    "`benchmarks/pallas_library/swap.py` serves each op's source with its "
    "Pallas imports pointed at dsl, and `tests/pallas/test_pallas_ops.py` "
    "runs one cheap shape per op on dsl's CPU backends (chosen with "
    "`dsl.default_backend`, since the ops name none) and compares it with "
    "the original op in Pallas's interpret mode and with the op's own "
    "reference. The `*_mgpu` ops (written against Pallas's Mosaic GPU API, "
    "`plgpu`) run on the interpret backend's warpgroup interpreter, on a "
    "simulated GPU of 2 SMs (`benchmarks/pallas_library/cases_mgpu.py`), "
    "and are compared with Pallas's GPU interpret mode. The default suite "
    "checks each op on one backend (`mosaic_interpret` for a TPU op, "
    "`interpret` for a GPU op) and the others under `pytest -m slow`. "
    "Under `pytest -m slow` it runs each op's variants the same "
    "way (`benchmarks/pallas_library/matrix_tpu.py`, `matrix_gpu.py`): "
    "other shapes and dtypes, the optional "
    "features, and gradients, through the op's own custom_vjp where it has "
    "one and through dsl's automatic reverse mode where it has none (those "
    "against the reference's gradient only: Pallas has no reverse mode "
    "there). A failing case is a strict xfail whose reason is the cause "
    "below; `tests/pallas/test_pallas_ops_limits.py` runs each failing "
    "case and each case compared with its reference only, unswapped, in "
    "Pallas's interpret mode and holds that Pallas fails on it too (the "
    "error named, NaN, or no reverse mode through pallas_call) or, for "
    "dsl's gaps, runs it. `vs Pallas` is the op's time on dsl's `interpret` over its time "
    "in Pallas's interpret mode (lower is faster; `python -m benchmarks "
    "--suite pallas-ops`, the record in "
    "`benchmarks/results/pallas-ops-cpu.json`, see "
    "[benchmarks.md](benchmarks.md)). `Mosaic module`, for a TPU op (on the "
    "`mosaic_interpret` row, whose module is the one the `mosaic` backend "
    "gives a TPU), is what `tests/pallas/test_pallas_ops_golden.py` finds "
    "when it lowers the op and each variant for a TPU, on the CPU, through "
    "dsl and through Pallas's own lowering of the original source: every "
    "`tpu_custom_call` the case emits (the backward kernels of the op's "
    "custom_vjp included) has the same canonicalized Mosaic module, "
    "backend config and call attributes (`equal`), or differs for the "
    "cause named; gradients through dsl's automatic reverse mode have no "
    "Pallas module to compare with. The variants that lower in well under "
    "a second are compared by default, the others under `pytest -m slow`. "
    "For a `*_mgpu` op (on the `interpret` row) it is the op's module on "
    "the `mosaic_gpu` backend, lowered for CUDA on the CPU, against "
    "Pallas's own Mosaic GPU lowering of the same source "
    "(`tests/pallas/test_plgpu_lowering.py`, `test_plgpu_collectives.py`; "
    "[mosaic-gpu.md](mosaic-gpu.md) says why each difference is no "
    "slower). This table is generated (`python -m tests.pallas.pallas_ops_page`) "
    "and a test checks it.")
# The backend row the `TPU module` column fills: its module is the one the
# `mosaic` backend gives a TPU.
_GOLDEN_BACKEND = "mosaic_interpret"


def _variant(case_id: str) -> str:
  return case_id[len(swap.base_op(case_id)) + 1:]


def _variants(op: str, backend: str) -> str:
  """The variants of `op` on `backend`: which pass, which fail and why, and
  which are compared with their reference only."""
  passing, failing, ref_only = [], [], []
  for v in MATRIX:
    if swap.base_op(v) != op:
      continue
    cause = swap.XFAIL.get((v, backend))
    if cause is not None:
      failing.append(f"{_variant(v)} fails: {cause}")
      continue
    passing.append(_variant(v))
    why = no_pallas(v)
    if why is not None and why != swap.NO_PALLAS.get(op):
      ref_only.append(f"{_variant(v)}: {why}")
  parts = []
  if passing:
    parts.append("pass: " + ", ".join(passing))
  parts += failing
  if ref_only:
    parts.append("compared with the reference only: " + "; ".join(ref_only))
  return "; ".join(parts) or "-"


def _ratio(op: str, backend: str, ratios: dict) -> str:
  if backend != speed.BACKEND:
    return ""
  r = ratios.get(op)
  return "-" if r is None else speed.report.fmt_ratio(r)


def _golden(op: str, backend: str) -> str:
  """Whether the op's and its variants' Mosaic modules are Pallas's (a
  `*_mgpu` op's: its Mosaic GPU module)."""
  if swap.is_mgpu(op):
    return swap.MGPU_MODULES[op] if backend == "interpret" else ""
  if backend != _GOLDEN_BACKEND or not op.startswith("tpu."):
    return ""
  cases = [op] + [v for v in MATRIX if swap.base_op(v) == op]
  label = lambda c: "the op" if c == op else _variant(c)
  golden = set(golden_cases())
  compared = [c for c in cases if c in golden]
  differ = [c for c in compared if c in swap.GOLDEN_DIFFERS]
  parts = []
  if len(differ) < len(compared):
    n = len(compared)
    parts.append(f"equal: {n - len(differ)} of {n} cases" if n > 1
                 else "equal")
  parts += [f"{label(c)} differs: {swap.GOLDEN_DIFFERS[c]}" for c in differ]
  rest = [label(c) for c in cases if c not in golden]
  if rest:
    parts.append("no Pallas module (dsl's reverse mode): " + ", ".join(rest))
  return "; ".join(parts)


def _failure(op: str, cause: str) -> str:
  """A failing op's result: whether Pallas's interpret mode fails on the
  same case too (test_pallas_ops_limits.py holds which)."""
  if op in swap.PALLAS_FAILS_TOO:
    return f"fails, as Pallas's interpret mode does: {cause}"
  return f"fails (a dsl gap: Pallas's interpret mode runs it): {cause}"


def compat_section() -> str:
  """The section of docs/pallas-compat.md that lists each op of
  `jax.experimental.pallas.ops` on each dsl CPU backend."""
  ratios = (speed.ratios(SPEED_RECORD) if os.path.exists(SPEED_RECORD)
            else {})
  lines = [_SECTION, "", _INTRO, "",
           "| op | backend | result | variants (`-m slow`) | vs Pallas | "
           "Mosaic module |",
           "|---|---|---|---|---|---|"]
  for op in swap.OPS:
    for backend in swap.backends_of(op):
      cause = swap.XFAIL.get((op, backend))
      result = "pass" if cause is None else _failure(op, cause)
      if op in swap.NO_PALLAS:
        result += (f" (compared with its reference only: "
                   f"{swap.NO_PALLAS[op]})")
      lines.append(f"| `{op}` | `{backend}` | {result} | "
                   f"{_variants(op, backend)} | "
                   f"{_ratio(op, backend, ratios)} | "
                   f"{_golden(op, backend)} |")
  return "\n".join(lines) + "\n"


def write_compat_section(path: str = COMPAT_PAGE) -> None:
  """Rewrites (or appends) the section in docs/pallas-compat.md."""
  with open(path, encoding="utf-8") as f:
    page = f.read()
  start = page.find(_SECTION + "\n")
  if start < 0:
    page = page.rstrip("\n") + "\n\n" + compat_section()
  else:
    end = page.find("\n## ", start + len(_SECTION))
    rest = "" if end < 0 else page[end:]
    page = page[:start] + compat_section() + rest
  with open(path, "w", encoding="utf-8") as f:
    f.write(page)


if __name__ == "__main__":
  write_compat_section()
