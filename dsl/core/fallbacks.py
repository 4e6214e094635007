"""Math written once, as lax operations, for backends without a rule of
their own.

A backend lowers a primitive through its rule table (docs/architecture.md).
Some primitives are math that a backend's target has no instruction for:
`erf_inv`, `cbrt`, `atan`, `atan2`, `log1p`, `expm1`, `sinh`, `cosh`. Instead of one copy of the
same polynomial per backend (Triton source, TPU MLIR, GPU MLIR), each is
written here once, in lax operations every backend lowers. Before a
backend's lowering, `dsl.core.normalize` replaces an equation of a
primitive of `FALLBACKS` with its fallback when that backend's rule table
has no rule for the primitive (`missing`) and the fallback serves the
operands' dtype; a backend with a rule of its own keeps it. The operations
a fallback emits are lowered by the backend's own rules, and a fallback may
emit another fallback's primitive (`erf_inv` emits `log1p`), which the same
normalization replaces in turn.

Each fallback serves float32, and float16 and bfloat16 by computing in
float32 and rounding the result (what the backends' own rules do for 16-bit
math). A float64 operand keeps the primitive, which the backend then refuses
with its usual error: these approximations are float32-accurate only.
docs/primitives.md marks each backend that gets a primitive this way
`fallback`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable

import numpy as np

from jax import lax

_FLOATS = (np.dtype(np.float32), np.dtype("bfloat16"), np.dtype(np.float16))


@dataclasses.dataclass(frozen=True)
class Fallback:
  """The lax form of one primitive: `fn(*operands, **params)`, for operands
  of the dtypes in `dtypes`."""
  fn: Callable
  dtypes: tuple = _FLOATS

  def serves(self, dtype) -> bool:
    return np.dtype(dtype) in self.dtypes


# primitive -> its lax form.
FALLBACKS: dict[Any, Fallback] = {}


def _fallback(primitive):
  """Registers a float32 function as the fallback of `primitive`; 16-bit
  operands are widened to float32 and the results rounded back."""
  def register(fn):
    def widened(*operands, **params):
      dtype = operands[0].dtype
      wide = [lax.convert_element_type(x, np.float32) for x in operands]
      out = fn(*wide, **params)
      return lax.convert_element_type(out, dtype)
    FALLBACKS[primitive] = Fallback(widened)
    return fn
  return register


def missing(rules) -> frozenset:
  """The primitives of `FALLBACKS` that the rule table `rules` has no rule
  for (`p in rules` asks the table)."""
  return frozenset(p for p in FALLBACKS if p not in rules)


def applies(primitive, avals_in: Iterable, primitives: frozenset) -> bool:
  """Whether an equation of `primitive` over operands of `avals_in` is
  replaced by its fallback, when `primitives` are the ones replaced."""
  if primitive not in primitives or primitive not in FALLBACKS:
    return False
  return all(FALLBACKS[primitive].serves(a.dtype) for a in avals_in)


def _k(x, value):
  return lax.full_like(x, value)


# ------------------------------------------------------------------ log1p

@_fallback(lax.log1p_p)
def _log1p(x, **_):
  """log(1 + x) without losing small x: with u = 1 + x rounded,
  log(u) * (x / (u - 1)) corrects the rounding of u (exact where u == 1)."""
  u = lax.add(_k(x, 1.0), x)
  corrected = lax.mul(lax.log(u), lax.div(x, lax.sub(u, _k(x, 1.0))))
  plain = lax.bitwise_or(lax.eq(u, _k(x, 1.0)), lax.eq(u, _k(x, np.inf)))
  return lax.select(plain, lax.select(lax.eq(u, _k(x, 1.0)), x, u),
                    corrected)


@_fallback(lax.expm1_p)
def _expm1(x, **_):
  """exp(x) - 1 without losing small x: with u = exp(x) rounded,
  (u - 1) * (x / log(u)) corrects the rounding of u."""
  u = lax.exp(x)
  one = _k(x, 1.0)
  corrected = lax.mul(lax.sub(u, one), lax.div(x, lax.log(u)))
  out = lax.select(lax.eq(lax.sub(u, one), _k(x, -1.0)), _k(x, -1.0),
                   corrected)
  out = lax.select(lax.eq(u, _k(x, np.inf)), u, out)
  return lax.select(lax.eq(u, one), x, out)


# ------------------------------------------------------------ sinh, cosh

def _half_exp(a):
  """exp(a) / 2 for a >= 0, finite up to the largest float32 result: as
  (exp(a / 2) / 2) * exp(a / 2), since a / 2 is exact and a - log(2) is
  not."""
  e = lax.exp(lax.mul(a, _k(a, 0.5)))
  return lax.mul(lax.mul(e, _k(a, 0.5)), e)


@_fallback(lax.sinh_p)
def _sinh(x, **_):
  """sign(x) * sinh|x|: (e + e / (e + 1)) / 2 with e = expm1|x| below 16
  (no cancellation near 0), exp(|x|) / 2 beyond."""
  a = lax.abs(x)
  e = lax.expm1(a)
  near = lax.mul(_k(a, 0.5), lax.add(e, lax.div(e, lax.add(e, _k(a, 1.0)))))
  s = lax.select(lax.lt(a, _k(a, 16.0)), near, _half_exp(a))
  s = lax.select(lax.lt(x, _k(x, 0.0)), lax.neg(s), s)
  return lax.select(lax.eq(a, _k(a, 0.0)), x, s)      # -0 stays -0


@_fallback(lax.cosh_p)
def _cosh(x, **_):
  """(e + 1 / e) / 2 with e = exp|x| below 16, exp(|x|) / 2 beyond."""
  a = lax.abs(x)
  e = lax.exp(a)
  near = lax.mul(_k(a, 0.5), lax.add(e, lax.div(_k(a, 1.0), e)))
  return lax.select(lax.lt(a, _k(a, 16.0)), near, _half_exp(a))


# ---------------------------------------------------------------- erf_inv

# Giles' single-precision approximation of erf_inv (also XLA's): with
# w = -log(1 - x^2), a degree-8 polynomial in w - 2.5 for w < 5 and in
# sqrt(w) - 3 beyond, times x. Coefficients from the highest power down.
_ERF_INV_CENTRAL = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06,
                    -4.39150654e-06, 0.00021858087, -0.00125372503,
                    -0.00417768164, 0.246640727, 1.50140941)
_ERF_INV_TAIL = (-0.000200214257, 0.000100950558, 0.00134934322,
                 -0.00367342844, 0.00573950773, -0.0076224613,
                 0.00943887047, 1.00167406, 2.83297682)


@_fallback(lax.erf_inv_p)
def _erf_inv(x, **_):
  # 0 - v rather than -v: the same result here (w >= 0), and the module a
  # TPU gets is then Pallas's, operation for operation.
  minus = lambda v: lax.sub(_k(v, 0.0), v)
  w = minus(lax.log1p(lax.mul(x, minus(x))))
  central = lax.lt(w, _k(w, 5.0))
  t = lax.select(central, lax.sub(w, _k(w, 2.5)),
                 lax.sub(lax.sqrt(w), _k(w, 3.0)))
  pick = lambda i: lax.select(central, _k(x, _ERF_INV_CENTRAL[i]),
                              _k(x, _ERF_INV_TAIL[i]))
  p = pick(0)
  for i in range(1, len(_ERF_INV_CENTRAL)):
    p = lax.add(pick(i), lax.mul(p, t))
  at_one = lax.eq(lax.abs(x), _k(x, 1.0))
  return lax.select(at_one, lax.mul(_k(x, np.inf), x), lax.mul(p, x))


# ------------------------------------------------------------------- cbrt

@_fallback(lax.cbrt_p)
def _cbrt(x, **_):
  """exp(log|x| / 3), refined by one Newton step on y^3 = |x|, with the
  sign of x; 0, inf and NaN come back as they went in (-0 and -inf too)."""
  a = lax.abs(x)
  y = lax.exp(lax.div(lax.log(a), _k(a, 3.0)))
  y = lax.div(lax.add(lax.add(y, y), lax.div(a, lax.mul(y, y))), _k(y, 3.0))
  signed = lax.select(lax.lt(x, _k(x, 0.0)), lax.neg(y), y)
  special = lax.bitwise_or(
      lax.bitwise_or(lax.eq(a, _k(a, 0.0)), lax.eq(a, _k(a, np.inf))),
      lax.ne(x, x))
  return lax.select(special, x, signed)


# ------------------------------------------------------------ atan, atan2

# atan on [0, tan(pi/8)] as an odd polynomial, t + t^3 * P(t^2) (a minimax
# fit for float32); wider arguments are first reduced by
# atan(t) = pi/4 + atan((t - 1) / (t + 1)).
_ATAN_POLY = (8.05374449538e-2, -1.38776856032e-1, 1.99777106478e-1,
              -3.33329491539e-1)
_TAN_PI_8 = math.tan(math.pi / 8)


def _atan_unit(t):
  """atan(t) for t in [0, 1] (NaN stays NaN)."""
  reduce = lax.gt(t, _k(t, _TAN_PI_8))
  r = lax.select(reduce, lax.div(lax.sub(t, _k(t, 1.0)),
                                 lax.add(t, _k(t, 1.0))), t)
  r2 = lax.mul(r, r)
  p = _k(r, _ATAN_POLY[0])
  for c in _ATAN_POLY[1:]:
    p = lax.add(lax.mul(p, r2), _k(r, c))
  a = lax.add(lax.mul(lax.mul(p, r2), r), r)
  return lax.select(reduce, lax.add(a, _k(a, math.pi / 4)), a)


def _negative(x):
  """Whether x has its sign bit set (-0.0 included): x < 0, or x == 0 with
  1 / x == -inf."""
  zero = _k(x, 0.0)
  return lax.bitwise_or(lax.lt(x, zero), lax.bitwise_and(
      lax.eq(x, zero), lax.lt(lax.div(_k(x, 1.0), x), zero)))


def _angle(small, large):
  """atan(small / large) for 0 <= small <= large, with 0/0 -> 0 and
  inf/inf -> pi/4."""
  both_inf = lax.eq(small, _k(small, np.inf))
  ratio = lax.select(lax.eq(large, _k(large, 0.0)), _k(small, 0.0),
                     lax.div(small, large))
  return _atan_unit(lax.select(both_inf, _k(small, 1.0), ratio))


@_fallback(lax.atan2_p)
def _atan2(y, x, **_):
  """The angle of (x, y) in (-pi, pi], with IEEE's signed zeros and
  infinities (atan2(+-0, -0) = +-pi, atan2(+-inf, -inf) = +-3pi/4); NaN in
  either operand gives NaN."""
  ay, ax = lax.abs(y), lax.abs(x)
  steep = lax.gt(ay, ax)
  a = _angle(lax.min(ay, ax), lax.max(ay, ax))
  a = lax.select(steep, lax.sub(_k(a, math.pi / 2), a), a)
  a = lax.select(_negative(x), lax.sub(_k(a, math.pi), a), a)
  a = lax.select(_negative(y), lax.neg(a), a)
  nan = lax.bitwise_or(lax.ne(x, x), lax.ne(y, y))
  return lax.select(nan, lax.add(x, y), a)


@_fallback(lax.atan_p)
def _atan(x, **_):
  """atan(x) = sign(x) * atan|x|, atan|x| = pi/2 - atan(1/|x|) past 1."""
  return _atan2(x, _k(x, 1.0))
