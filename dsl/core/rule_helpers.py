"""Recipes that the lowerings' rules share, written once over the
lowering's own operations."""
from __future__ import annotations

from typing import Callable, TypeVar

V = TypeVar("V")


def power_by_squaring(base: V, n: int, mul: Callable[[V, V], V],
                      square: Callable[[V], V] | None = None) -> V:
  """`base ** n` for an integer n >= 1 by repeated squaring: about log2(n)
  squarings (`square`, default `mul(b, b)`) and one `mul` per set bit."""
  if n < 1:
    raise ValueError(f"power_by_squaring needs n >= 1, got {n}")
  square = square or (lambda b: mul(b, b))
  acc = None
  while True:
    if n & 1:
      acc = base if acc is None else mul(acc, base)
    n >>= 1
    if not n:
      return acc
    base = square(base)
