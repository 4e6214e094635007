"""The `window` family: memory addressed by values computed at run time.

Each grid point reads a window `x_ref[pl.ds(s, b)]` of a whole-array input
and writes a window `o_ref[pl.ds(t, b)]` of a whole-array output, the starts
`s` and `t` read from a scalar-prefetch table; a start may put the window
partly or wholly outside its ref (before the start or past the end), whose
lanes there read poison and write nothing on every backend. The output is
aliased to an input (rows no window writes keep it) or not (they are poison:
memory nobody wrote). The value stored may combine with a Python scalar
operand (weakly typed, as Pallas takes it).

Or (`atomic`) each grid point applies an atomic add, max, min, and, or or
xor through an array of indices read from an input, with repeats and
indices outside the output (dropped), into an aliased output: every lane
applies, one after another.
"""
from __future__ import annotations

import numpy as np

from tests.pallas.fuzz.common import Draw, tolerance, unit_leaves
from tests.pallas.fuzz.expr import ExprGen
from tests.pallas.fuzz.family_accumulate import _tags
from tests.pallas.fuzz.spec import (FLOATS, INTS, Case, Operand, is_float)

ATOMIC_DTYPES = {"add": ("int32", "float32"), "max": ("int32", "float32"),
                 "min": ("int32", "float32"), "and": ("int32",),
                 "or": ("int32",), "xor": ("int32",)}
SCALAR_OPS = {"add": lambda xp, a, b: a + b, "mul": lambda xp, a, b: a * b,
              "max": lambda xp, a, b: xp.maximum(a, b)}


def generate(d: Draw, seed: int, index: int, tpu: bool) -> Case:
  if d.chance(0.35):
    return _generate_atomic(d, seed, index)
  return _generate_window(d, seed, index)


def _start(d: Draw, n: int, b: int) -> int:
  """A window start: mostly inside, often across an end, now and then
  wholly outside."""
  r = d.rng.random()
  if r < 0.5:
    return d.int(0, n - b)
  if r < 0.8 and b > 1:
    return d.pick([d.int(-b + 1, -1), d.int(n - b + 1, n - 1)])
  return d.pick([-b - d.int(0, 3), n + d.int(0, 3), d.int(-(1 << 20), -b)])


def _generate_window(d: Draw, seed: int, index: int) -> Case:
  rows = d.pick([8, 16, 24])
  cols = d.pick([None, 128]) if d.chance(0.6) else None
  shape = (rows,) if cols is None else (rows, cols)
  b = d.pick([1, 2, 4, 8])
  grid = (d.int(1, 3),)
  in_dtype = d.pick(FLOATS + INTS)
  out_dtype = d.pick(FLOATS + INTS + ("bool",))
  x = Operand(shape, in_dtype, nan=is_float(in_dtype) and d.chance(0.1))
  out = Operand(shape, out_dtype)
  ins = [x]
  aliases = ()
  if d.chance(0.4):
    ins.append(out)
    aliases = ((1, 0),)
  scalar = None
  if out_dtype != "bool" and d.chance(0.4):
    scalar = d.pick(sorted(SCALAR_OPS))
    ins.append(Operand((), "float32" if is_float(out_dtype) else "int32",
                       space="scalar"))
  starts = []
  for _ in range(grid[0]):
    starts += [_start(d, rows, b), _start(d, rows, b)]
  wshape = (b,) if cols is None else (b, cols)
  leaves = {"w": (wshape, in_dtype), "pid0": ((), "int32")}
  expr = ExprGen(d.rng, leaves, wshape, {"cast", "iota"},
                 d.int(1, 2)).full(out_dtype)
  body = dict(expr=expr, b=b, scalar=scalar, scalar_k=len(ins) - 1,
              tol=(tolerance([expr], out_dtype) * (2 if scalar else 1),))
  tags = {"window_from_data", "alias" if aliases else "unwritten_rows"}
  outside = [s for s in starts if s < 0 or s + b > rows]
  tags |= {"window_outside"} if outside else set()
  tags |= {f"python_scalar:{scalar}"} if scalar else set()
  tags |= expr.tags((), unit_leaves(grid))
  return Case(seed, index, "window", grid, tuple(ins), (out,),
              tuple(body.items()), tuple(starts), None, aliases,
              frozenset(_tags(tags, ins, (out,), grid, False)))


def _generate_atomic(d: Draw, seed: int, index: int) -> Case:
  op = d.pick(sorted(ATOMIC_DTYPES))
  dtype = d.pick(ATOMIC_DTYPES[op])
  n, b = d.pick([4, 8, 16]), d.pick([4, 8, 16, 32])
  grid = (d.int(1, 3),)
  # indices with repeats, and a few outside the output (dropped)
  idx = Operand((grid[0] * b,), "int32", space="index")
  vals = Operand((grid[0] * b,), dtype)
  base = Operand((n,), dtype)
  body = dict(op=op, b=b, n=n, masked=d.chance(0.4), tol=(1e-6,))
  tags = {"atomic_indices", f"atomic_indices_{op}:{dtype}"}
  tags |= {"masked_atomic"} if body["masked"] else set()
  return Case(seed, index, "window", grid, (idx, vals, base), (base,),
              tuple(body.items()), None, None, ((2, 0),),
              frozenset(_tags(tags, (idx, vals, base), (base,), grid, False)))


def body(case: Case, ctx) -> None:
  if case.param("op") is not None:
    _body_atomic(case, ctx)
    return
  p = case.param
  b = p("b")
  x = case.inputs[0]
  i = ctx.pid(0)
  sizes = (b,) + x.shape[1:]
  zeros = (0,) * (len(x.shape) - 1)
  s = ctx.prefetched(2 * i)
  t = ctx.prefetched(2 * i + 1)
  w = ctx.load_window(0, (s,) + zeros, sizes, None, None)
  v = ctx.eval(p("expr"), {"w": w, "pid0": i})
  if p("scalar"):
    v = ctx.with_scalar(p("scalar"), v, p("scalar_k"))
  ctx.store_window(0, (t,) + zeros, sizes, v, None)


def _body_atomic(case: Case, ctx) -> None:
  p = case.param
  b = p("b")
  i = ctx.pid(0)
  idx = ctx.load_window(0, (i * b,), (b,), None, None)
  vals = ctx.load_window(1, (i * b,), (b,), None, None)
  mask = (ctx.xp.arange(b) % 3 != 1) if p("masked") else None
  ctx.atomic_indexed(p("op"), 0, idx, vals, mask)


def apply_scalar(xp, name: str, v, s):
  """`v <op> s` for a Python (weakly typed) scalar `s`: the result keeps
  `v`'s dtype, as JAX's promotion gives (numpy computes 16-bit floats in
  float32 and rounds once, which is the same)."""
  if xp is not np:
    return SCALAR_OPS[name](xp, v, s)
  wide = v.astype(np.float32) if is_float(str(v.dtype)) else v
  return np.asarray(SCALAR_OPS[name](np, wide, s)).astype(v.dtype)
