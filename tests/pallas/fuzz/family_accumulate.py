"""Families whose state lives across grid steps.

- `reduce`: trailing grid axes revisit an output block, which accumulates
  (sum, max or min) in the output itself or in a scratch buffer written at
  the last step;
- `matmul`: blocked `jnp.dot` over a k axis, inputs masked past K, with an
  f32/i32 accumulator and an epilogue;
- `carry`: a scratch buffer carried across an `arbitrary` grid axis whose
  output block changes at every step (running column sums).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from tests.pallas.fuzz.common import (Draw, extent, input_dims, is_partial,
                                      load_inputs, loop_leaves, output_dims,
                                      small_block, sublane, tolerance,
                                      tpu_block, unit_leaves)
from tests.pallas.fuzz.expr import ExprGen, dt, safe_cast
from tests.pallas.fuzz.spec import (FLOATS, INTS, Case, Dim, Operand,
                                    is_float)


def _combine(xp, kind, a, b):
  return {"sum": lambda: a + b, "max": lambda: xp.maximum(a, b),
          "min": lambda: xp.minimum(a, b)}[kind]()


def _neutral(kind, dtype):
  if kind == "sum":
    return 0
  if is_float(dtype):
    return -np.inf if kind == "max" else np.inf
  info = np.iinfo(np.dtype(jnp.dtype(dtype)))
  return info.min if kind == "max" else info.max


def _accumulate(case, ctx, w, axes):
  """Folds `w` into the output (or scratch) over the grid axes `axes`: the
  first step stores, the others combine; scratch is copied out last."""
  p = case.param
  kind, where = p("kind"), p("storage")
  xp = ctx.xp
  first = functools.reduce(xp.logical_and, [ctx.pid(a) == 0 for a in axes])
  last = functools.reduce(xp.logical_and, [ctx.pid(a) == case.grid[a] - 1
                                           for a in axes])
  out_dt = dt(case.outputs[0].dtype)
  if where == "scratch":
    get, put = (lambda: ctx.scratch_get(0)), (lambda v: ctx.scratch_set(0, v))
    w = w.astype(dt(p("scratch")[0][2]))
  else:
    get, put = (lambda: ctx.read_out(0)), (lambda v: ctx.store(0, v))
    w = w.astype(out_dt)
  if p("zero_init"):
    ctx.when(first, lambda: put(xp.full(w.shape, _neutral(kind, str(w.dtype)),
                                         w.dtype)))
    put(_combine(xp, kind, get(), w))
  else:
    ctx.when(first, lambda: put(w))
    ctx.when(xp.logical_not(first), lambda: put(_combine(xp, kind, get(), w)))
  if where == "scratch":
    ctx.when(last, lambda: ctx.store(0, _finish(case, ctx, get())))


def _finish(case, ctx, acc):
  epi = case.param("epilogue")
  if epi is None:
    return acc.astype(dt(case.outputs[0].dtype))
  env = {f"pid{a}": ctx.pid(a) for a in range(len(case.grid))}
  return ctx.eval(epi, {**env, "acc": acc})


def _masks(d: Draw, ins, grid):
  return tuple((k, d.pick(["where", "where", "masked_load"]))
               for k, op in enumerate(ins)
               if op.dims is not None and is_partial(op, grid, None))


def _epilogue(d: Draw, shape, acc_dtype, out_dtype, grid, exact):
  if not d.chance(0.5):
    return None
  leaves = {"acc": (shape, acc_dtype, exact)}
  leaves.update({f"pid{a}": ((), "int32") for a in range(len(grid))})
  return ExprGen(d.rng, leaves, shape, {"cast"}, d.int(1, 2)).full(out_dtype)


def _tags(case_tags, ins, outs, grid, tpu):
  tags = set(case_tags) | {f"grid{len(grid)}"}
  if tpu:
    tags.add("tpu_legal")
  for op in list(ins) + list(outs):
    tags.add(f"dtype:{op.dtype}")
    if op.nan:
      tags.add("nan")
    if op.dims is not None:
      tags |= {f"dim:{x.kind}:{x.src}" for x in op.dims}
  return tags


# ---- reduce

def generate_reduce(d: Draw, seed: int, index: int, tpu: bool) -> Case:
  n_red = d.int(1, 2)
  n_par = d.int(0, 3 - n_red)
  grid = tuple(d.int(1, 3) for _ in range(n_par + n_red))
  red_axes = tuple(range(n_par, n_par + n_red))
  kind = d.pick(["sum", "sum", "max", "min"])
  storage = d.pick(["out", "scratch"])
  krank = d.pick([1, 2, 2, 3])
  if kind == "sum" and storage == "out":
    out_dtype = acc = d.pick(["float32", "int32"])
  else:
    out_dtype = d.pick(FLOATS + INTS)
    acc = "float32" if is_float(out_dtype) else "int32"
    acc = acc if storage == "scratch" else out_dtype
  in_dtypes = [d.pick(FLOATS + INTS + ("bool",)) for _ in range(d.int(1, 2))]
  kshape = tpu_block(d, krank, in_dtypes + [out_dtype, acc]) if tpu else \
      small_block(d, krank)
  inner = ()
  if krank >= 2 and (not tpu or krank == 3) and d.chance(0.5):
    inner = (0,) if tpu else tuple(sorted(set(
        d.int(0, krank - 1) for _ in range(d.int(1, krank - 1)))))
  out_kshape = tuple(n for k, n in enumerate(kshape) if k not in inner)
  ins = []
  for t in in_dtypes:
    dims, shape = input_dims(d, grid, kshape, tpu, False)
    ins.append(Operand(shape, t, dims, nan=is_float(t) and d.chance(0.1)))
  odims, oshape = output_dims(d, grid[:n_par], out_kshape, tpu, False)
  outs = [Operand(oshape, out_dtype, odims)]
  leaves = {f"x{k}": (op.kshape, op.dtype) for k, op in enumerate(ins)}
  leaves.update({f"pid{a}": ((), "int32") for a in range(len(grid))})
  allow = {"cast", "iota"} | ({"reduce"} if d.chance(0.2) else set())
  expr = ExprGen(d.rng, leaves, kshape, allow, d.int(1, 3)).full(acc)
  scratch = ((("vmem", out_kshape, acc),) if storage == "scratch" else ())
  epilogue = _epilogue(d, out_kshape, acc, out_dtype, grid,
                       expr.exact and kind != "sum" or not is_float(acc)) \
      if storage == "scratch" else None
  body = dict(expr=expr, kind=kind, storage=storage, inner=inner,
              red_axes=red_axes,
              zero_init=d.chance(0.3), scratch=scratch, epilogue=epilogue,
              masks=_masks(d, ins, grid), none_squeeze=d.chance(0.5))
  n_terms = int(np.prod([kshape[k] for k in inner] + [1])) * int(
      np.prod([grid[a] for a in red_axes]))
  summed = [expr, epilogue] + ([] if kind != "sum" or not is_float(acc) else
                               [_rounding(acc)] * min(8, n_terms))
  body["tol"] = (tolerance(summed, out_dtype),)
  semantics = None
  if d.chance(0.5):
    semantics = ("parallel",) * n_par + ("arbitrary",) * n_red
  tags = {"revisit", f"acc:{storage}", f"acc_kind:{kind}"}
  tags |= {"zero_init"} if body["zero_init"] else set()
  tags |= {"reduce_in_kernel", f"op:reduce_{kind}:{acc}"} if inner else set()
  loops, units = loop_leaves(grid, red_axes), unit_leaves(grid)
  tags |= expr.tags(loops, units) | (epilogue.tags(loops, units)
                                     if epilogue is not None else set())
  tags |= {f"partial_in"} if body["masks"] else set()
  return Case(seed, index, "reduce", grid, tuple(ins), tuple(outs),
              tuple(body.items()), None, semantics, (),
              frozenset(_tags(tags, ins, outs, grid, tpu)))


def _rounding(dtype):
  """A stand-in Expr for one rounding step of `dtype` in a tolerance."""
  from tests.pallas.fuzz.expr import Expr
  leaf = Expr("leaf", (), "_", (), dtype, True)
  return Expr("add", (leaf, leaf), None, (), dtype, False)


def body_reduce(case: Case, ctx) -> None:
  p = case.param
  env = load_inputs(case, ctx, dict(p("masks")))
  v = ctx.eval(p("expr"), env)
  for axis in reversed(p("inner")):
    if p("kind") == "sum":
      v = ctx.xp.sum(v, axis, dtype=v.dtype)
    else:
      v = (ctx.xp.max if p("kind") == "max" else ctx.xp.min)(v, axis)
  _accumulate(case, ctx, v, p("red_axes"))


# ---- matmul

def generate_matmul(d: Draw, seed: int, index: int, tpu: bool) -> Case:
  dt = d.pick(["float32", "bfloat16", "float16", "int8"])
  pref = "int32" if dt == "int8" else "float32"
  storage = d.pick(["out", "scratch"])
  out_dtype = pref if storage == "out" else d.pick(
      ["int32", "int8"] if dt == "int8" else FLOATS)
  gi, gj, gk = d.int(1, 2), d.int(1, 2), d.int(1, 3)
  if tpu:
    bm, bk, bn = sublane(dt) * d.pick([1, 2]), 128, 128
  else:
    bm, bk, bn = (d.pick([16, 16, 32, 8]) for _ in range(3))
  m, k, n = extent(d, gi, bm), extent(d, gk, bk), extent(d, gj, bn)
  trans = d.chance(0.3)
  # 16-bit dots whose operands hold inf, NaN, -0.0 and their largest values
  special = dt in ("float16", "bfloat16") and d.chance(0.3)
  x = Operand((m, k), dt, (Dim("blocked", bm, "axis", 0),
                           Dim("blocked", bk, "axis", 2)), special=special)
  if trans:
    y = Operand((n, k), dt, (Dim("blocked", bn, "axis", 1),
                             Dim("blocked", bk, "axis", 2)), special=special)
  else:
    y = Operand((k, n), dt, (Dim("blocked", bk, "axis", 2),
                             Dim("blocked", bn, "axis", 1)), special=special)
  out = Operand((m, n), out_dtype, (Dim("blocked", bm, "axis", 0),
                                    Dim("blocked", bn, "axis", 1)))
  grid = (gi, gj, gk)
  scratch = (("vmem", (bm, bn), pref),) if storage == "scratch" else ()
  epilogue = _epilogue(d, (bm, bn), pref, out_dtype, grid, pref == "int32") \
      if storage == "scratch" else None
  masks = tuple((i, d.pick(["where", "masked_load"])) for i, op in
                enumerate((x, y)) if is_partial(op, grid, None))
  body = dict(trans=trans, pref=pref, highest=d.chance(0.5), kind="sum",
              storage=storage, zero_init=d.chance(0.3), scratch=scratch,
              epilogue=epilogue, masks=masks)
  if pref == "float32":
    body["tol"] = (tolerance([epilogue] + [_rounding(pref)] * 8, out_dtype),)
  else:
    body["tol"] = (0.0,)
  tags = {"revisit", "dot", f"dot:{dt}->{pref}", f"acc:{storage}",
          "trans_b" if trans else "dot_nn"}
  tags |= {"zero_init"} if body["zero_init"] else set()
  tags |= epilogue.tags(loop_leaves(grid, (2,)), unit_leaves(grid)) \
      if epilogue is not None else set()
  tags |= {"partial_in"} if masks else set()
  tags |= {"dot_special_values"} if special else set()
  semantics = ("parallel", "parallel", "arbitrary") if d.chance(0.5) else None
  return Case(seed, index, "matmul", grid, (x, y), (out,),
              tuple(body.items()), None, semantics, (),
              frozenset(_tags(tags, (x, y), (out,), grid, tpu)))


def body_matmul(case: Case, ctx) -> None:
  import jax
  p = case.param
  env = load_inputs(case, ctx, dict(p("masks")), fill=0)
  x, y = env["x0"], env["x1"]
  if p("trans"):
    y = y.T
  pref = dt(p("pref"))
  if ctx.xp is np:
    prod = np.dot(x.astype(pref), y.astype(pref))
  else:
    kw = dict(preferred_element_type=pref)
    if p("highest"):
      kw["precision"] = jax.lax.Precision.HIGHEST
    prod = jnp.dot(x, y, **kw)
  _accumulate(case, ctx, prod, (2,))


# ---- carry

def generate_carry(d: Draw, seed: int, index: int, tpu: bool) -> Case:
  cols = d.chance(0.5)
  gi, gj = d.int(1, 4), (d.int(1, 2) if cols else 1)
  in_dtype = d.pick(FLOATS + INTS)
  out_dtype = d.pick(FLOATS + INTS)
  # an inexact f32 running sum would round differently before an int cast
  acc = d.pick(["float32", "int32"]) if is_float(out_dtype) else "int32"
  if tpu:
    bm, bn = max(sublane(in_dtype), sublane(out_dtype)), 128
  else:
    bm, bn = d.pick([1, 2, 3, 4]), d.pick([1, 2, 4, 8])
  r, c = extent(d, gi, bm), extent(d, gj, bn)
  grid = (gj, gi) if cols else (gi,)
  ia, ja = (1, 0) if cols else (0, None)
  col = Dim("blocked", bn, "axis", ja) if cols else Dim("blocked", bn,
                                                        "const", 0)
  if not cols:
    c = bn
  dims = (Dim("blocked", bm, "axis", ia), col)
  x = Operand((r, c), in_dtype, dims, nan=is_float(in_dtype) and d.chance(0.1))
  out = Operand((r, c), out_dtype, dims)
  leaves = {"x0": ((bm, bn), in_dtype)}
  leaves.update({f"pid{a}": ((), "int32") for a in range(len(grid))})
  expr = ExprGen(d.rng, leaves, (bm, bn), {"cast", "iota"},
                 d.int(1, 2)).full(acc)
  masks = ((0, d.pick(["where", "masked_load"])),) if is_partial(
      x, grid, None) else ()
  sem = ("parallel", "arbitrary") if cols else ("arbitrary",)
  # A dim declared "parallel" that carries the scratch: the kernel reads it
  # before writing it at every step, which every dsl backend refuses when
  # the kernel is traced (a KernelError naming the dim and the scratch).
  parallel_carry = d.chance(0.2)
  if parallel_carry:
    sem = ("parallel",) * len(grid)
  body = dict(expr=expr, axis=ia, masks=masks, read_first=parallel_carry,
              scratch=(("vmem", (1, bn), acc),))
  body["tol"] = (tolerance([expr] + [_rounding(acc)] * gi, out_dtype),)
  tags = {"carry", "scratch_carried"} | expr.tags(loop_leaves(grid, (ia,)),
                                                  unit_leaves(grid))
  tags |= {"partial_in"} if masks else set()
  tags |= {"parallel_carry"} if parallel_carry else set()
  return Case(seed, index, "carry", grid, (x,), (out,), tuple(body.items()),
              None, sem, (), frozenset(_tags(tags, (x,), (out,), grid, tpu)))


def body_carry(case: Case, ctx) -> None:
  p = case.param
  env = load_inputs(case, ctx, dict(p("masks")))
  if p("read_first"):        # the carry, read before anything writes it
    c = ctx.scratch_get(0)
    ctx.scratch_set(0, c + ctx.xp.sum(ctx.eval(p("expr"), env), axis=0,
                                      keepdims=True, dtype=c.dtype))
  ctx.when(ctx.pid(p("axis")) == 0,
           lambda: ctx.scratch_set(0, ctx.xp.zeros(ctx.scratch_get(0).shape,
                                                   ctx.scratch_get(0).dtype)))
  v = ctx.eval(p("expr"), env)
  c = ctx.scratch_get(0)
  ctx.store(0, safe_cast(v + c, case.outputs[0].dtype, ctx.xp))
  ctx.scratch_set(0, c + ctx.xp.sum(v, axis=0, keepdims=True, dtype=v.dtype))


# ---- order

def generate_order(d: Draw, seed: int, index: int, tpu: bool) -> Case:
  """Scratch carried across every grid dim, all `arbitrary`: an
  accumulator reset under `pl.when(pl.program_id(a) == 0)` for one axis,
  or only at the first grid point, so that each output block holds the sum
  of the values of every grid point visited before it (and its own) in the
  TPU's row-major order, which every backend must follow."""
  grid = tuple(d.int(1, 3) for _ in range(d.int(2, 3)))
  in_dtype = d.pick(FLOATS + INTS)
  out_dtype = d.pick(FLOATS + INTS)
  acc = d.pick(["float32", "int32"]) if is_float(out_dtype) else "int32"
  if tpu:
    bm, bn = max(sublane(in_dtype), sublane(out_dtype)), 128
  else:
    bm, bn = d.pick([1, 2, 3, 4]), d.pick([1, 2, 4, 8])
  a, b = (int(v) for v in d.rng.permutation(len(grid))[:2])
  x = Operand((grid[a] * bm, grid[b] * bn), in_dtype,
              (Dim("blocked", bm, "axis", a), Dim("blocked", bn, "axis", b)),
              nan=is_float(in_dtype) and d.chance(0.1))
  out = Operand(grid + (bm, bn), out_dtype, tuple(
      Dim("squeezed", 1, "axis", k) for k in range(len(grid))) + (
          Dim("blocked", bm, "const", 0), Dim("blocked", bn, "const", 0)))
  leaves = {"x0": ((bm, bn), in_dtype)}
  leaves.update({f"pid{k}": ((), "int32") for k in range(len(grid))})
  expr = ExprGen(d.rng, leaves, (bm, bn), {"cast", "iota"},
                 d.int(1, 2)).full(acc)
  reset = None if d.chance(0.4) else d.int(0, len(grid) - 1)
  n_points = int(np.prod(grid))
  body = dict(expr=expr, reset=reset, scratch=(("vmem", (bm, bn), acc),),
              none_squeeze=d.chance(0.5),
              tol=(tolerance([expr] + [_rounding(acc)] * min(8, n_points),
                             out_dtype),))
  sem = d.pick([None, ("arbitrary",) * len(grid)])
  tags = {"carry", "scratch_carried", "carry_order",
          "carry_reset:first_point" if reset is None else
          f"carry_reset:axis{reset}"}
  tags |= expr.tags(loop_leaves(grid, range(len(grid))), unit_leaves(grid))
  return Case(seed, index, "order", grid, (x,), (out,), tuple(body.items()),
              None, sem, (), frozenset(_tags(tags, (x,), (out,), grid, tpu)))


def body_order(case: Case, ctx) -> None:
  p = case.param
  xp = ctx.xp
  env = load_inputs(case, ctx, {})
  axes = range(len(case.grid)) if p("reset") is None else (p("reset"),)
  first = functools.reduce(xp.logical_and, [ctx.pid(a) == 0 for a in axes])
  ctx.when(first, lambda: ctx.scratch_set(0, xp.zeros(
      ctx.scratch_get(0).shape, ctx.scratch_get(0).dtype)))
  c = ctx.scratch_get(0) + ctx.eval(p("expr"), env)
  ctx.scratch_set(0, c)
  ctx.store(0, safe_cast(c, case.outputs[0].dtype, xp))
