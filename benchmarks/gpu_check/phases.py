"""The GPU check's phases: what each runs, and the time it may take.

Every phase is a separate process with a hard time limit (its budget), so
the whole check stays under `LIMIT_S` on an H100/H200 whatever one phase
does; a phase over its budget is stopped and recorded as `timeout`.
"""
from __future__ import annotations

import dataclasses
import os
import sys

LIMIT_S = 8 * 60          # the whole check, on an H100/H200
PREFLIGHT_S = 15          # device, versions and commit, before the phases
REPORT_S = 10             # the record, the comparison, the table refresh
KERNELS = ("kernels.softmax", "kernels.layer_norm", "kernels.rms_norm",
           "kernels.matmul", "kernels.flash_attention")


class PlanError(ValueError):
  """An unknown phase name."""


@dataclasses.dataclass(frozen=True)
class Phase:
  name: str
  title: str
  budget_s: int
  argv: tuple[str, ...]          # after the Python interpreter
  output: str | None             # the JSON file it writes, in the out dir
  env: tuple[tuple[str, str], ...] = ()

  def command(self, out_dir: str, python: str = sys.executable) -> list[str]:
    return [python] + [a.replace("{out}", out_dir) for a in self.argv]

  def environment(self, out_dir: str) -> dict:
    return dict(os.environ, DSL_BENCH_MALLOC="0", **{
        k: v.replace("{out}", out_dir) for k, v in self.env})


def _cli(*args: str, output: str) -> tuple[str, ...]:
  return ("-m", "benchmarks", *args, "--skip-slow-peers", "--progress",
          "never", "--json", "{out}/" + output)


def _tests_workers() -> str:
  return str(max(1, min(8, (os.cpu_count() or 2) - 2)))


PHASES = (
    Phase("tests", "GPU-marked tests (pytest -m gpu)", 90,
          ("-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
           "-n", _tests_workers(), "tests", "--junitxml", "{out}/tests.xml"),
          "tests.xml", (("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),)),
    Phase("triton", "Triton matmul and rows vs cuBLAS, XLA and Pallas "
          "(benchmarks/gpu_triton.py)", 55,
          ("benchmarks/gpu_triton.py", "--json", "{out}/triton.json"),
          "triton.json"),
    Phase("attention", "flash attention on Triton and Mosaic GPU vs cuDNN "
          "and Pallas; row kernels vs the copy (benchmarks.gpu_attention)",
          80, ("-m", "benchmarks.gpu_attention", "--backends",
               "triton,mosaic_gpu", "--json", "{out}/attention.json"),
          "attention.json"),
    Phase("mosaic", "kernels/ and matmul on Mosaic GPU beside Triton, bf16, "
          "with XLA and Pallas (Mosaic GPU / Triton) peers", 60,
          _cli("--kernels", ",".join(("matmul",) + KERNELS), "--backends",
               "triton,mosaic_gpu", "--dtype", "bfloat16", "--repeats", "5",
               output="mosaic.json"), "mosaic.json"),
    Phase("quick", "the quick suite at the shipped defaults "
          "(python -m benchmarks --quick)", 70,
          _cli("--quick", output="quick.json"), "quick.json"),
    Phase("tune", "the quick suite's Triton rows autotuned from the shipped "
          "defaults (the winners refresh the table)", 90,
          _cli("--quick", "--backends", "triton", "--autotune", "--retune",
               "--tune-repeats", "1", "--tune-budget", "4", "--repeats", "3",
               output="tune.json"), "tune.json",
          (("DSL_AUTOTUNE_CACHE", "{out}/autotune.json"),)),
)
NAMES = tuple(p.name for p in PHASES)


def select(only: list[str] | None = None, skip: list[str] | None = None
           ) -> list[Phase]:
  """The phases to run, in plan order; unknown names raise PlanError."""
  for name in (only or []) + (skip or []):
    if name not in NAMES:
      raise PlanError(f"unknown phase {name!r}; phases: {', '.join(NAMES)}")
  return [p for p in PHASES if (not only or p.name in only)
          and p.name not in (skip or [])]


def total_budget(phases=PHASES) -> int:
  """The longest the check can take with these phases."""
  return PREFLIGHT_S + sum(p.budget_s for p in phases) + REPORT_S


def describe(phases, out_dir: str) -> str:
  lines = [f"{'phase':<10} {'budget':>7}  what", "-" * 72]
  for p in phases:
    lines.append(f"{p.name:<10} {p.budget_s:>6}s  {p.title}")
    lines.append(f"{'':<19}$ python {' '.join(p.command(out_dir)[1:])}")
  lines.append(f"{'total':<10} {total_budget(phases):>6}s  (with "
               f"{PREFLIGHT_S}s before and {REPORT_S}s after the phases; "
               f"limit {LIMIT_S}s)")
  return "\n".join(lines)
