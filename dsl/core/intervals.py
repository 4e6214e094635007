"""Integer intervals and the arithmetic of JAX's integer operations on them.

An `Interval(lo, hi)` holds every value an integer (or bool) takes: for an
array, every element. Each operation here returns an interval that contains
every result the operation can produce on operands inside its argument
intervals, with JAX's semantics (two's-complement wrap-around: a result that
may leave its dtype's range is that whole range; `lax.div` rounds toward
zero, `lax.rem` takes the dividend's sign). `dsl.core.ranges` runs them over
kernel jaxprs. Nothing here knows about jaxprs or backends.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np


@dataclasses.dataclass(frozen=True)
class Interval:
  """The integers lo..hi, both included (lo <= hi)."""
  lo: int
  hi: int

  def __post_init__(self):
    if self.lo > self.hi:
      raise ValueError(f"empty interval [{self.lo}, {self.hi}]")

  @classmethod
  def const(cls, value) -> "Interval":
    v = int(value)
    return cls(v, v)

  @classmethod
  def hull(cls, values) -> "Interval":
    values = [int(v) for v in values]
    return cls(min(values), max(values))

  @property
  def is_const(self) -> bool:
    return self.lo == self.hi

  def join(self, other: "Interval") -> "Interval":
    return Interval(min(self.lo, other.lo), max(self.hi, other.hi))

  def within(self, lo: int, hi: int) -> bool:
    return lo <= self.lo and self.hi <= hi

  def __contains__(self, value) -> bool:
    return self.lo <= int(value) <= self.hi

  def __add__(self, other: "Interval") -> "Interval":
    return Interval(self.lo + other.lo, self.hi + other.hi)

  def __sub__(self, other: "Interval") -> "Interval":
    return Interval(self.lo - other.hi, self.hi - other.lo)

  def __neg__(self) -> "Interval":
    return Interval(-self.hi, -self.lo)

  def __mul__(self, other: "Interval") -> "Interval":
    return Interval.hull(a * b for a in (self.lo, self.hi)
                         for b in (other.lo, other.hi))

  def scale(self, k: int) -> "Interval":
    return self * Interval.const(k)

  def __repr__(self):
    return f"[{self.lo}, {self.hi}]"


def join_all(intervals) -> Interval | None:
  """The hull of the intervals; None if any is None (unknown)."""
  out = None
  for iv in intervals:
    if iv is None:
      return None
    out = iv if out is None else out.join(iv)
  return out


# ------------------------------------------------------------------ dtypes

def is_integer(dtype) -> bool:
  try:
    dtype = np.dtype(dtype)
  except TypeError:
    return False
  return dtype == np.bool_ or np.issubdtype(dtype, np.integer)


def dtype_range(dtype) -> Interval | None:
  """Every value of an integer or bool dtype; None for other dtypes."""
  if not is_integer(dtype):
    return None
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return Interval(0, 1)
  info = np.iinfo(dtype)
  return Interval(int(info.min), int(info.max))


def fit(iv: Interval | None, dtype) -> Interval | None:
  """`iv` as values of `dtype`: itself when every value is representable,
  else the whole range (the arithmetic wrapped around)."""
  full = dtype_range(dtype)
  if full is None or iv is None:
    return full
  return iv if iv.within(full.lo, full.hi) else full


# ------------------------------------------------------------ arithmetic

def _trunc_div(a: int, b: int) -> int:
  q = abs(a) // abs(b)
  return q if (a >= 0) == (b > 0) else -q


def _dividend_corners(a: Interval) -> list[int]:
  # Division is monotone in the dividend on each side of zero.
  return [a.lo, a.hi] + ([0] if a.lo < 0 < a.hi else [])


def div(a: Interval, b: Interval) -> Interval | None:
  """`lax.div` on integers (rounds toward zero); None when b may be 0."""
  if 0 in b:
    return None
  return Interval.hull(_trunc_div(x, y) for x in _dividend_corners(a)
                       for y in (b.lo, b.hi))


def floor_div(a: Interval, b: Interval) -> Interval | None:
  """Python's `a // b` (jnp.floor_divide); None when b may be 0."""
  if 0 in b:
    return None
  return Interval.hull(x // y for x in _dividend_corners(a)
                       for y in (b.lo, b.hi))


def rem(a: Interval, b: Interval) -> Interval | None:
  """`lax.rem` (the remainder takes the dividend's sign); None when b may
  be 0."""
  if 0 in b:
    return None
  m = max(abs(b.lo), abs(b.hi)) - 1        # the largest |remainder|
  least = min(abs(b.lo), abs(b.hi))
  if a.within(-(least - 1), least - 1):
    return a                                # |a| < |b|: a itself
  if a.lo >= 0:
    return Interval(0, min(a.hi, m))
  if a.hi <= 0:
    return Interval(max(a.lo, -m), 0)
  return Interval(-m, m)


def py_mod(a: Interval, b: Interval) -> Interval | None:
  """Python's `a % b` (jnp.remainder: the divisor's sign); None when b may
  be 0."""
  if 0 in b:
    return None
  if b.lo > 0:
    if a.within(0, b.lo - 1):
      return a
    return Interval(0, b.hi - 1)
  if b.hi < 0:
    if a.within(b.hi + 1, 0):
      return a
    return Interval(b.lo + 1, 0)
  return None


def minimum(a: Interval, b: Interval) -> Interval:
  return Interval(min(a.lo, b.lo), min(a.hi, b.hi))


def maximum(a: Interval, b: Interval) -> Interval:
  return Interval(max(a.lo, b.lo), max(a.hi, b.hi))


def absolute(a: Interval) -> Interval:
  if a.lo >= 0:
    return a
  if a.hi <= 0:
    return -a
  return Interval(0, max(-a.lo, a.hi))


def sign(a: Interval) -> Interval:
  s = lambda v: (v > 0) - (v < 0)
  return Interval(s(a.lo), s(a.hi))


def bitwise_and(a: Interval, b: Interval) -> Interval | None:
  """`a & b`: known when one operand is non-negative (then so is the
  result, and it is at most that operand)."""
  bounds = [x.hi for x in (a, b) if x.lo >= 0]
  if not bounds:
    return None
  return Interval(0, min(bounds))


def bitwise_or(a: Interval, b: Interval) -> Interval | None:
  """`a | b` of non-negative operands: below the next power of two."""
  if a.lo < 0 or b.lo < 0:
    return None
  top = max(a.hi, b.hi)
  return Interval(max(a.lo, b.lo), (1 << top.bit_length()) - 1)


def shift_left(a: Interval, k: Interval, bits: int) -> Interval | None:
  if not k.within(0, bits - 1):
    return None
  return Interval.hull(x << s for x in (a.lo, a.hi) for s in (k.lo, k.hi))


def shift_right(a: Interval, k: Interval, bits: int) -> Interval | None:
  """Arithmetic shift (floor division by 2**k)."""
  if not k.within(0, bits - 1):
    return None
  return Interval.hull(x >> s for x in (a.lo, a.hi) for s in (k.lo, k.hi))


def compare(op: str, a: Interval, b: Interval) -> Interval:
  """A comparison's result as a bool interval: [1, 1] when it holds for
  every pair, [0, 0] when for none."""
  always, never = {
      "lt": (a.hi < b.lo, a.lo >= b.hi),
      "le": (a.hi <= b.lo, a.lo > b.hi),
      "gt": (a.lo > b.hi, a.hi <= b.lo),
      "ge": (a.lo >= b.hi, a.hi < b.lo),
      "eq": (a.is_const and b.is_const and a.lo == b.lo,
             a.hi < b.lo or b.hi < a.lo),
      "ne": (a.hi < b.lo or b.hi < a.lo,
             a.is_const and b.is_const and a.lo == b.lo),
  }[op]
  return Interval(1, 1) if always else Interval(0, 0) if never else \
      Interval(0, 1)


def select(which: Interval, cases: list) -> Interval | None:
  """`lax.select_n(which, *cases)`: the hull of the cases `which` can pick."""
  lo, hi = max(which.lo, 0), min(which.hi, len(cases) - 1)
  if lo > hi:           # out-of-range selectors: any case
    lo, hi = 0, len(cases) - 1
  return join_all(cases[lo:hi + 1])


def corners(*intervals: Interval):
  """Every combination of the intervals' bounds (for monotone functions)."""
  return itertools.product(*((iv.lo, iv.hi) for iv in intervals))
