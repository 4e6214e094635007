"""Random typed expressions over kernel values, and their evaluation.

An `Expr` is a small tree of jax.numpy operations on named leaves (the
blocks a kernel loaded, program ids, a loop's carried value). The same tree
is evaluated inside a kernel (on traced blocks) and by the reference (on
numpy blocks, eagerly), so both compute with jax.numpy's semantics.

Every operation's result is defined on every backend: divisors are never
zero, float -> int casts clip and map NaN to 0, shifts stay below the bit
width. Operations that jump on a tiny change of their operand (comparisons,
`floor`, float -> int casts, `argmax`) take only *exact* operands: values
every backend computes bit for bit (inputs, integers, f32 +-*, min/max, ...),
never the result of a transcendental or of low-precision float arithmetic.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from tests.pallas.fuzz.spec import FLOATS, INTS, is_float, is_int

_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Expr:
  op: str
  args: tuple["Expr", ...] = ()
  attr: Any = None
  shape: tuple[int, ...] = ()
  dtype: str = "float32"
  exact: bool = True

  def __str__(self):
    if self.op == "leaf":
      return str(self.attr)
    if self.op == "const":
      return f"{self.attr}:{self.dtype}"
    inner = ", ".join(str(a) for a in self.args)
    attr = "" if self.attr is None else f"[{self.attr}]"
    return f"{self.op}{attr}({inner})"

  def walk(self):
    yield self
    for a in self.args:
      yield from a.walk()

  def tags(self, loop_leaves=(), unit_leaves=()) -> set[str]:
    """Feature tags: one per operation, with the dtype it works on;
    `cast_of_loop_index` when a cast takes one of `loop_leaves` (program ids
    of grid dims that run as loops, a loop's index), `cast_of_unit_index`
    when it takes one of `unit_leaves` (program ids of size-1 grid dims)."""
    out = set()
    for e in self.walk():
      if e.op == "cast" and e.args[0].op == "leaf":
        if e.args[0].attr in loop_leaves:
          out.add("cast_of_loop_index")
        if e.args[0].attr in unit_leaves:
          out.add("cast_of_unit_index")
      if e.op in ("leaf", "const", "bcast"):
        continue
      src = e.args[0].dtype if e.args else e.dtype
      name = e.op if e.op not in ("reduce", "scalar") else \
          f"{e.op}_{e.attr[0]}" + ("_reshaped" if e.op == "scalar" and
                                    e.attr[1] else "")
      out.add(f"op:{name}")
      out.add(f"op:{name}:{src}")
      if e.op == "cast":
        out.add(f"cast:{src}->{e.dtype}")
      if e.op == "dot":
        out.add(f"dot:{e.attr[2]}->{e.dtype}")
      if e.op == "roll" and e.attr[0] % e.shape[e.attr[1]] == 0:
        out.add("roll_by_0_or_size")
      if e.shape == () and e.op in UNARY:
        out.add(f"scalar_op:{e.op}")
    return out

  @property
  def cross(self) -> bool:
    """Whether an element of the result depends on other positions."""
    return any(e.op in CROSS for e in self.walk())

  def inexact_ops(self) -> list[str]:
    """dtypes of the operations whose result may differ by rounding."""
    return [e.dtype for e in self.walk() if e.args and not e.exact]


CROSS = ("reduce", "dot", "roll", "scalar", "cum")


# ---- evaluation: the same code inside a kernel (xp = jax.numpy, on traced
# blocks) and in the reference (xp = numpy, on numpy blocks)

def dt(name: str) -> np.dtype:
  return np.dtype(jnp.dtype(name))


def _const(xp, v, dtype):
  return xp.asarray(v, dt(dtype))


def iota(xp, shape, dim):
  if xp is jnp:
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)
  ax = np.arange(shape[dim], dtype=np.int32).reshape(
      [n if k == dim else 1 for k, n in enumerate(shape)])
  return np.broadcast_to(ax, shape)


def safe_cast(x, dtype: str, xp=jnp):
  """`x` as `dtype`; float -> int clips to the int's range and maps NaN to 0."""
  if is_float(str(x.dtype)) and is_int(dtype):
    lo, hi = (-1e9, 1e9) if dtype == "int32" else (
        np.iinfo(dt(dtype)).min, np.iinfo(dt(dtype)).max)
    # The bounds in x's own type, as JAX's weak typing gives them to the
    # kernels (numpy would clip a bfloat16 value in float64).
    lo, hi = xp.asarray(lo, x.dtype), xp.asarray(hi, x.dtype)
    x = xp.where(xp.isnan(x), xp.zeros_like(x), xp.clip(x, lo, hi))
  return x.astype(dt(dtype))


def _divisor(xp, b):
  return xp.abs(b) % _const(xp, 7, b.dtype) + _const(xp, 1, b.dtype)


def _dot_matrix(xp, pattern: str, n: int, dtype: str):
  i, j = iota(xp, (n, n), 0), iota(xp, (n, n), 1)
  m = {"triu": i <= j, "tril": i >= j, "eye": i == j,
       "mod3": (i + 2 * j) % 3 == 0, "ones": i >= 0}[pattern]
  return m.astype(dt(dtype))


def _dot(xp, a, attr):
  side, pattern, dot_dtype, pref, highest = attr
  a = a.astype(dt(dot_dtype))
  n = a.shape[1] if side == "right" else a.shape[0]
  s = _dot_matrix(xp, pattern, n, dot_dtype)
  lhs, rhs = (a, s) if side == "right" else (s, a)
  if xp is np:   # products are exact in the wider type
    return np.dot(lhs.astype(dt(pref)), rhs.astype(dt(pref)))
  kw = dict(preferred_element_type=dt(pref))
  if highest:
    kw["precision"] = _HIGHEST
  return jnp.dot(lhs, rhs, **kw)


def _reduce(xp, x, attr):
  kind, axis = attr
  if kind in ("argmax", "argmin"):
    f = xp.argmax if kind == "argmax" else xp.argmin
    return f(x, axis=axis, keepdims=True).astype(np.int32)
  if kind == "sum":
    wide = np.float32 if is_float(str(x.dtype)) else np.int32
    return xp.sum(x.astype(wide), axis=axis, keepdims=True,
                  dtype=wide).astype(x.dtype)
  f = xp.max if kind == "max" else xp.min
  return f(x, axis=axis, keepdims=True)


def _cumulative(xp, x, attr):
  """cumsum or cummax of `x` along `axis`, in `x`'s dtype."""
  kind, axis = attr
  if xp is np:
    if kind == "cumsum":
      return np.cumsum(x, axis, dtype=x.dtype)
    return np.maximum.accumulate(x, axis)
  if kind == "cumsum":
    return jnp.cumsum(x, axis, dtype=x.dtype)
  return jax.lax.cummax(x, axis)


def _scalar(xp, x, attr):
  """A reduction over every axis, as a scalar or reshaped to ones."""
  kind, keep = attr
  if kind == "first":           # one element, reshaped to a scalar
    r = xp.reshape(x[(slice(0, 1),) * x.ndim], ())
  elif kind == "sum":
    wide = np.float32 if is_float(str(x.dtype)) else np.int32
    r = xp.sum(x.astype(wide), dtype=wide).astype(x.dtype)
  else:
    r = (xp.max if kind == "max" else xp.min)(x)
  return xp.reshape(r, (1,) * x.ndim) if keep else r


def _sigmoid(xp, x):
  if xp is jnp:
    return jax.nn.sigmoid(x)
  one = _const(xp, 1, x.dtype)
  return one / (one + np.exp(-x))


UNARY: dict[str, Callable] = {
    "neg": lambda xp, x: -x,
    "abs": lambda xp, x: xp.abs(x),
    "square": lambda xp, x: x * x,
    "invert": lambda xp, x: ~x,
    "floor": lambda xp, x: xp.floor(x),
    "tanh": lambda xp, x: xp.tanh(x),
    "sin": lambda xp, x: xp.sin(x),
    "exp": lambda xp, x: xp.exp(x),
    "sigmoid": _sigmoid,
    "log1p_abs": lambda xp, x: xp.log1p(xp.abs(x)),
    "sqrt_abs": lambda xp, x: xp.sqrt(xp.abs(x)),
}

BINARY: dict[str, Callable] = {
    "add": lambda xp, a, b: a + b,
    "sub": lambda xp, a, b: a - b,
    "mul": lambda xp, a, b: a * b,
    "max": lambda xp, a, b: xp.maximum(a, b),
    "min": lambda xp, a, b: xp.minimum(a, b),
    "div": lambda xp, a, b: a / (xp.abs(b) + _const(xp, 1, b.dtype)),
    "floordiv": lambda xp, a, b: a // _divisor(xp, b),
    "rem": lambda xp, a, b: a % _divisor(xp, b),
    "and": lambda xp, a, b: a & b,
    "or": lambda xp, a, b: a | b,
    "xor": lambda xp, a, b: a ^ b,
}

COMPARE: dict[str, Callable] = {
    "lt": lambda a, b: a < b, "le": lambda a, b: a <= b,
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
    "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b,
}

OTHER: dict[str, Callable] = {
    "where": lambda xp, e, c, a, b: xp.where(c, a, b),
    "cast": lambda xp, e, x: safe_cast(x, e.dtype, xp),
    "bcast": lambda xp, e, x: xp.broadcast_to(x, e.shape),
    "shl": lambda xp, e, x: xp.left_shift(x, _const(xp, e.attr, e.dtype)),
    "shr": lambda xp, e, x: xp.right_shift(x, _const(xp, e.attr, e.dtype)),
    "reduce": lambda xp, e, x: _reduce(xp, x, e.attr),
    "dot": lambda xp, e, x: _dot(xp, x, e.attr),
    "roll": lambda xp, e, x: xp.roll(x, e.attr[0], axis=e.attr[1]),
    "cum": lambda xp, e, x: _cumulative(xp, x, e.attr),
    "scalar": lambda xp, e, x: _scalar(xp, x, e.attr),
}


def evaluate(e: Expr, env: dict[str, Any], xp=jnp):
  """The value of `e`; `env` maps leaf names to values."""
  op = e.op
  if op == "leaf":
    return env[e.attr]
  if op == "const":
    return _const(xp, e.attr, e.dtype)
  if op == "iota":
    return iota(xp, e.shape, e.attr)
  args = [evaluate(a, env, xp) for a in e.args]
  if op in UNARY:
    out = UNARY[op](xp, args[0])
  elif op in BINARY:
    out = BINARY[op](xp, *args)
  elif op in COMPARE:
    out = COMPARE[op](*args)
  else:
    out = OTHER[op](xp, e, *args)
  return xp.asarray(out) if xp is np else out


# ---- generation

# Which operations apply to which dtype class, and whether they keep an exact
# operand exact: (classes, exact for f32/ints, exact for 16-bit floats).
UNARY_RULES = {
    "neg": ("fi", True, True), "abs": ("fi", True, True),
    "square": ("fi", True, False), "invert": ("ib", True, True),
    "floor": ("f", True, True), "tanh": ("f", False, False),
    "sin": ("f", False, False), "exp": ("f", False, False),
    "sigmoid": ("f", False, False), "log1p_abs": ("f", False, False),
    "sqrt_abs": ("f", False, False),
}
BINARY_RULES = {
    "add": ("fi", True, False), "sub": ("fi", True, False),
    "mul": ("fi", True, False), "max": ("fi", True, True),
    "min": ("fi", True, True), "div": ("f", False, False),
    "floordiv": ("i", True, True), "rem": ("i", True, True),
    "and": ("ib", True, True), "or": ("ib", True, True),
    "xor": ("ib", True, True),
}
NEEDS_EXACT = {"floor"}


def _cls(dtype: str) -> str:
  return "f" if is_float(dtype) else "i" if is_int(dtype) else "b"


def _keeps_exact(dtype: str, rule) -> bool:
  return rule[2] if dtype in ("bfloat16", "float16") else rule[1]


class ExprGen:
  """Draws random expressions of a given dtype over `leaves`.

  leaves: name -> (shape, dtype[, exact]); every shape broadcasts to
  `shape`; a leaf computed with rounding is marked exact=False.
  allow: the families of operations on offer ("reduce", "dot", "roll",
  "iota", "cast"); the elementwise ones are always on.
  """

  def __init__(self, rng: np.random.Generator, leaves, shape, allow=(),
               max_depth: int = 3):
    self.rng = rng
    self.leaves = dict(leaves)
    self.shape = tuple(shape)
    self.allow = set(allow)
    self.max_depth = max_depth

  def choice(self, seq):
    return seq[int(self.rng.integers(len(seq)))]

  def full(self, dtype: str, depth: int | None = None, exact=False) -> Expr:
    """An expression of `dtype` with exactly the shape `self.shape`."""
    e = self.gen(dtype, self.max_depth if depth is None else depth, exact)
    return self._bcast(e)

  def _bcast(self, e: Expr) -> Expr:
    if e.shape == self.shape:
      return e
    return Expr("bcast", (e,), None, self.shape, e.dtype, e.exact)

  def gen(self, dtype: str, depth: int, exact=False) -> Expr:
    if depth <= 0 or self.rng.random() < 0.2:
      return self.leaf(dtype, exact)
    makers = [self._unary, self._binary, self._where]
    if dtype == "bool":
      makers += [self._compare, self._compare]
    if "cast" in self.allow:
      makers.append(self._cast)
    if "reduce" in self.allow:
      makers.append(self._reduce)
      makers.append(self._scalar)
    if "dot" in self.allow and len(self.shape) == 2 and dtype != "bool":
      makers.append(self._dot)
    if "roll" in self.allow and self.shape:
      makers.append(self._roll)
    if "cum" in self.allow and self.shape and dtype in ("float32", "int32"):
      makers.append(self._cum)
    if is_int(dtype):
      makers.append(self._shift)
    for _ in range(4):
      e = self.choice(makers)(dtype, depth - 1, exact)
      if e is not None:
        return e
    return self.leaf(dtype, exact)

  def leaf(self, dtype: str, exact=False) -> Expr:
    r = self.rng.random()
    if r < 0.1:
      return Expr("const", (), self._const_value(dtype), (), dtype, True)
    if r < 0.2 and "iota" in self.allow and self.shape:
      e = Expr("iota", (), int(self.rng.integers(len(self.shape))),
               self.shape, "int32", True)
      return self._to(e, dtype)
    names = sorted(n for n, v in self.leaves.items()
                   if not exact or len(v) < 3 or v[2])
    if not names:
      return Expr("const", (), self._const_value(dtype), (), dtype, True)
    name = self.choice(names)
    shape, ldtype = self.leaves[name][:2]
    ok = len(self.leaves[name]) < 3 or self.leaves[name][2]
    e = Expr("leaf", (), name, tuple(shape), ldtype, ok)
    return self._to(e, dtype)

  def _const_value(self, dtype: str):
    if dtype == "bool":
      return bool(self.rng.integers(2))
    if is_int(dtype):
      lo = 0 if dtype == "uint8" else -5
      return int(self.rng.integers(lo, 6))
    return float(self.choice([0.5, -1.5, 2.0, 3.0, -0.25]))

  def _to(self, e: Expr, dtype: str) -> Expr:
    """`e` as `dtype` (a cast that keeps it defined and exact)."""
    if e.dtype == dtype:
      return e
    if dtype == "bool" and is_float(e.dtype):
      zero = Expr("const", (), 0.0, (), e.dtype, True)
      return Expr("ne", (e, zero), None, e.shape, "bool", e.exact)
    return Expr("cast", (e,), None, e.shape, dtype, e.exact)

  def _unary(self, dtype, depth, exact):
    names = [n for n, r in UNARY_RULES.items() if _cls(dtype) in r[0]
             and (not exact or _keeps_exact(dtype, r))]
    if not names:
      return None
    name = self.choice(names)
    a = self.gen(dtype, depth, exact or name in NEEDS_EXACT)
    ok = a.exact and _keeps_exact(dtype, UNARY_RULES[name])
    return Expr(name, (a,), None, a.shape, dtype, ok)

  def _binary(self, dtype, depth, exact):
    names = [n for n, r in BINARY_RULES.items() if _cls(dtype) in r[0]
             and (not exact or _keeps_exact(dtype, r))]
    name = self.choice(names)
    a, b = self.gen(dtype, depth, exact), self.gen(dtype, depth, exact)
    ok = a.exact and b.exact and _keeps_exact(dtype, BINARY_RULES[name])
    return Expr(name, (a, b), None, np.broadcast_shapes(a.shape, b.shape),
                dtype, ok)

  def _where(self, dtype, depth, exact):
    c = self.gen("bool", depth, True)
    a, b = self.gen(dtype, depth, exact), self.gen(dtype, depth, exact)
    shape = np.broadcast_shapes(c.shape, a.shape, b.shape)
    return Expr("where", (c, a, b), None, shape, dtype, a.exact and b.exact)

  def _compare(self, dtype, depth, exact):
    src = self.choice(FLOATS + INTS + ("bool",))
    names = ["eq", "ne"] if src == "bool" else sorted(COMPARE)
    a, b = self.gen(src, depth, True), self.gen(src, depth, True)
    return Expr(self.choice(names), (a, b), None,
                np.broadcast_shapes(a.shape, b.shape), "bool", True)

  def _cast(self, dtype, depth, exact):
    src = self.choice([d for d in FLOATS + INTS + ("bool",) if d != dtype])
    need = exact or is_int(dtype) or dtype == "bool"
    a = self.gen(src, depth, need)
    if dtype == "bool" and is_float(src):
      return self._to(a, dtype) if a.exact else None
    return Expr("cast", (a,), None, a.shape, dtype, a.exact)

  def _shift(self, dtype, depth, exact):
    a = self.gen(dtype, depth, exact)
    return Expr(self.choice(["shl", "shr"]), (a,), int(self.rng.integers(1, 4)),
                a.shape, dtype, a.exact)

  def _reduce(self, dtype, depth, exact):
    if not self.shape:
      return None
    axis = int(self.rng.integers(len(self.shape)))
    keep = tuple(1 if k == axis else n for k, n in enumerate(self.shape))
    if dtype == "int32" and self.rng.random() < 0.3:
      src = self.choice([d for d in FLOATS + INTS])
      kind = self.choice(["argmax", "argmin"])
      a = self._bcast(self.gen(src, depth, True))
      return Expr("reduce", (a,), (kind, axis), keep, "int32", True)
    if dtype == "bool":
      return None
    kind = self.choice(["sum", "max", "min"])
    a = self._bcast(self.gen(dtype, depth, exact))
    ok = a.exact and (kind != "sum" or not is_float(dtype))
    if exact and not ok:
      return None
    return Expr("reduce", (a,), (kind, axis), keep, dtype, ok)

  def _scalar(self, dtype, depth, exact):
    """A reduction of a whole block (or its first element) to a scalar,
    kept as one or reshaped to ones; broadcast back by its user."""
    if not self.shape or dtype == "bool":
      return None
    kind = self.choice(["sum", "max", "min", "first"])
    a = self._bcast(self.gen(dtype, depth, exact))
    ok = a.exact and (kind != "sum" or not is_float(dtype))
    if exact and not ok:
      return None
    keep = bool(self.rng.integers(2))
    shape = (1,) * len(self.shape) if keep else ()
    return Expr("scalar", (a,), (kind, keep), shape, dtype, ok)

  def _dot(self, dtype, depth, exact):
    dot_dtype = self.choice(["float32", "bfloat16", "float16", "int8"])
    pref = "int32" if dot_dtype == "int8" else "float32"
    if exact and pref == "float32":
      return None
    a = self._bcast(self.gen(dot_dtype, depth, pref == "int32"))
    side = self.choice(["left", "right"])
    pattern = self.choice(["triu", "tril", "eye", "mod3", "ones"])
    highest = pref == "float32" and bool(self.rng.integers(2))
    e = Expr("dot", (a,), (side, pattern, dot_dtype, pref, highest),
             self.shape, pref, pref == "int32" and a.exact)
    return self._to(e, dtype) if e.exact or not (
        is_int(dtype) or dtype == "bool") else None

  def _roll(self, dtype, depth, exact):
    axis = int(self.rng.integers(len(self.shape)))
    shift = int(self.rng.integers(0, self.shape[axis] + 1))
    a = self._bcast(self.gen(dtype, depth, exact))
    return Expr("roll", (a,), (shift, axis), self.shape, dtype, a.exact)

  def _cum(self, dtype, depth, exact):
    """cumsum (inexact in f32: its order of additions is the backend's)
    or cummax along one axis of the full shape."""
    axis = int(self.rng.integers(len(self.shape)))
    kind = self.choice(["cumsum", "cummax"])
    if kind == "cumsum" and exact and dtype == "float32":
      kind = "cummax"
    a = self._bcast(self.gen(dtype, depth, exact))
    ok = a.exact and (kind == "cummax" or dtype == "int32")
    return Expr("cum", (a,), (kind, axis), self.shape, dtype, ok)
