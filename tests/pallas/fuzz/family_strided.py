"""The `strided` family: strided windows of block refs.

Each grid point reads one or two windows `x_ref[pl.ds(s, n, stride=k)]`
(along the rows, or for blocks off the TPU tiling rule now and then along
the last dim; static starts, every window inside its block), computes a
random expression of them, and writes it:

- `plain`: to the whole output block;
- `over_base`: the output block is filled with a constant, then the value
  is stored through a strided window `o_ref[pl.ds(t, n, stride=k)]`;
- `interleave`: two values stored to the even and the odd rows (or
  columns), which together cover the block.

A share of the float cases also runs `jax.jvp` (as the `map` family does):
the tangents of a strided read are a strided read, those of a strided write
a strided write. The expressions may hold cumsum and cummax.
"""
from __future__ import annotations

from tests.pallas.fuzz.common import Draw, loop_leaves, tolerance, unit_leaves
from tests.pallas.fuzz.expr import ExprGen
from tests.pallas.fuzz.family_accumulate import _tags
from tests.pallas.fuzz.spec import FLOATS, INTS, Case, Dim, Operand, is_float

WRITES = ("plain", "plain", "over_base", "interleave")


def _window(d: Draw, n: int, tile: int):
  """(start, stride, rows of the block that holds it)."""
  stride = d.pick([1, 2, 2, 3, 4])
  start = d.int(0, stride + 2)
  need = start + (n - 1) * stride + 1
  rows = -(-need // tile) * tile + (tile if d.chance(0.2) else 0)
  return start, stride, rows


def generate(d: Draw, seed: int, index: int, tpu: bool) -> Case:
  axis = 0 if tpu or d.chance(0.7) else 1
  dtypes = ("float32", "int32", "bfloat16") if tpu else FLOATS + INTS
  in_dtypes = [d.pick(dtypes) for _ in range(d.int(1, 2))]
  out_dtype = d.pick(dtypes)
  tile = 8 if tpu and axis == 0 else 1
  n = 8 * d.int(1, 2) if tpu else d.int(1, 6)
  other = 128 if tpu else d.pick([1, 3, 4, 8])
  grid = tuple(d.int(1, 3) for _ in range(d.pick([0, 1, 1])))
  wins = [_window(d, n, tile) for _ in in_dtypes]
  rows_in = max(r for _, _, r in wins)
  write = d.pick(WRITES)
  if write == "plain":
    out_win, rows_out = None, n
  elif write == "interleave":
    out_win, rows_out = (0, 2), 2 * n
  else:
    s, k, rows_out = _window(d, n, tile)
    out_win = (s, k)
  ins = [_operand(rows_in, other, axis, t, grid) for t in in_dtypes]
  out = _operand(rows_out, other, axis, out_dtype, grid)
  wshape = (n, other) if axis == 0 else (other, n)
  leaves = {f"w{k}": (wshape, t) for k, t in enumerate(in_dtypes)}
  leaves.update({f"pid{a}": ((), "int32") for a in range(len(grid))})
  allow = {"cast", "iota"} | ({"cum"} if d.chance(0.4) else set())
  gen = ExprGen(d.rng, leaves, wshape, allow, d.int(1, 3))
  exprs = (gen.full(out_dtype),) + ((gen.full(out_dtype),)
                                    if write == "interleave" else ())
  jvp = is_float(out_dtype) and any(is_float(t) for t in in_dtypes) and \
      d.chance(0.4)
  body = dict(axis=axis, n=n, wins=tuple((s, k) for s, k, _ in wins),
              write=write, out_win=out_win, exprs=exprs,
              base=gen._const_value(out_dtype) if write == "over_base"
              else None,
              jvp=jvp, tol=(tolerance(list(exprs), out_dtype),))
  tags = {"strided", f"strided_write:{write}", f"strided_axis:{axis}"}
  tags |= {f"stride:{k}" for _, k, _ in wins} | ({"jvp", "jvp_strided"}
                                                 if jvp else set())
  for e in exprs:
    tags |= e.tags(loop_leaves(grid), unit_leaves(grid))
  return Case(seed, index, "strided", grid, tuple(ins), (out,),
              tuple(body.items()), None, None, (),
              frozenset(_tags(tags, ins, (out,), grid, tpu)))


def _operand(rows: int, other: int, axis: int, dtype: str, grid) -> Operand:
  """A 2-D operand whose strided dim holds `rows` per block; with a grid
  the blocks follow grid axis 0 along the other dim."""
  g = grid[0] if grid else 1
  along = Dim("blocked", other, "axis", 0) if grid else None
  whole = Dim("blocked", rows, "const", 0)
  if axis == 0:
    shape, dims = (rows, other * g), (whole, along)
  else:
    shape, dims = (other * g, rows), (along, whole)
  return Operand(shape, dtype, dims if grid else None)


def _win(case: Case, start: int, stride: int):
  """(start, size, stride) per dim of a window along the case's axis."""
  p = case.param
  other = case.outputs[0].kshape[1 - p("axis")]
  strided, full = (start, p("n"), stride), (0, other, 1)
  return (strided, full) if p("axis") == 0 else (full, strided)


def body(case: Case, ctx) -> None:
  p = case.param
  xp = ctx.xp
  env = {f"pid{a}": ctx.pid(a) for a in range(len(case.grid))}
  for k, (s, stride) in enumerate(p("wins")):
    env[f"w{k}"] = ctx.load_strided(k, _win(case, s, stride))
  values = [ctx.eval(e, env) for e in p("exprs")]
  out = case.outputs[0]
  if p("write") == "plain":
    ctx.store(0, values[0])
    return
  if p("write") == "over_base":
    ctx.store(0, xp.full(out.kshape, p("base"), values[0].dtype))
    ctx.store_strided(0, _win(case, *p("out_win")), values[0])
    return
  ctx.store_strided(0, _win(case, 0, 2), values[0])
  ctx.store_strided(0, _win(case, 1, 2), values[1])
