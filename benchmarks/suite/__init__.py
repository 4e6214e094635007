"""The benchmark kernels: our own (written once against a `pl` module so the
same source runs under dsl and jax.experimental.pallas) and, when importable,
the `kernels/` library's."""
from __future__ import annotations

from benchmarks.suite.add import Add
from benchmarks.suite.base import KernelBench, max_rel_err
from benchmarks.suite.matmul_bench import Matmul
from benchmarks.suite.newcomer import NEWCOMER
from benchmarks.suite.rowwise import LayerNorm, Softmax

SUITE = (Add(), Matmul(), Softmax(), LayerNorm()) + NEWCOMER

_EXTERNAL = None


def external_kernels():
  global _EXTERNAL
  if _EXTERNAL is None:
    import importlib
    _EXTERNAL = importlib.import_module("benchmarks.suite.external").discover()
  return _EXTERNAL


def all_kernels(include_external: bool = True) -> list[KernelBench]:
  return list(SUITE) + (external_kernels() if include_external else [])


def by_name() -> dict[str, KernelBench]:
  return {k.name: k for k in all_kernels()}


__all__ = ["SUITE", "KernelBench", "all_kernels", "by_name",
           "external_kernels", "max_rel_err"]
