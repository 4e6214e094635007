"""Families that address memory themselves instead of through BlockSpecs.

- `tail`: the Triton idiom on whole-array refs: each program loads the
  window `pl.ds(i * b, b)` (running past the array end in the last one)
  with a mask and `other`, and stores its result with the same mask -- or
  adds it atomically (add, max, min, and, or, xor) into one output that
  starts from an aliased input;
- `dma`: the TPU idiom: the input stays in HBM (`memory_space=ANY`) and the
  kernel copies its rows into VMEM scratch with async copies and DMA
  semaphores, one block at a time or double-buffered (start block i + 1,
  wait for block i).
"""
from __future__ import annotations

import jax.numpy as jnp

from tests.pallas.fuzz.common import (Draw, extent, load_inputs,
                                      loop_leaves, sublane, tolerance,
                                      unit_leaves)
from tests.pallas.fuzz.expr import ExprGen, iota
from tests.pallas.fuzz.family_accumulate import _rounding, _tags
from tests.pallas.fuzz.spec import (DTYPES, FLOATS, INTS, Case, Dim, Operand,
                                    fill_value, is_float)

ATOMIC_DTYPES = {"add": ("int32", "float32"), "max": ("int32", "float32"),
                 "min": ("int32", "float32"), "and": ("int32",),
                 "or": ("int32",), "xor": ("int32",)}


# ---- tail

def generate_tail(d: Draw, seed: int, index: int, tpu: bool) -> Case:
  rank = d.pick([1, 1, 2])
  if rank == 1:
    block = (d.pick([4, 5, 8, 16, 32]),)
  else:
    block = (d.pick([1, 2, 4, 8]), d.pick([2, 4, 8, 16]))
  grid = tuple(d.int(1, 3) for _ in block)
  shape = tuple(extent(d, g, b) for g, b in zip(grid, block))
  kind = d.pick(["store", "store", "atomic"])
  dtypes = [d.pick(DTYPES) for _ in range(d.int(1, 2))]
  # NaN only for stores: a float atomic max/min with NaN is not defined
  ins = [Operand(shape, t, nan=is_float(t) and kind == "store" and
                 d.chance(0.1)) for t in dtypes]
  divisible = all(n % b == 0 for n, b in zip(shape, block))
  masked = not divisible or d.chance(0.7)
  leaves = {f"x{k}": (block, op.dtype) for k, op in enumerate(ins)}
  leaves.update({f"pid{a}": ((), "int32") for a in range(len(grid))})
  allow = {"cast", "iota"} | ({"reduce"} if d.chance(0.3) else set())
  gen = ExprGen(d.rng, leaves, block, allow, d.int(1, 3))
  aliases, tags = (), {"tail", "masked_window" if masked else "window"}
  if kind == "atomic":
    op = d.pick(sorted(ATOMIC_DTYPES))
    out = Operand(block, d.pick(ATOMIC_DTYPES[op]), space="any")
    aliases = ((len(ins), 0),)
    ins.append(out)
    tags |= {f"atomic_{op}", f"atomic_{op}:{out.dtype}"}
  else:
    op = None
    out = Operand(shape, d.pick(DTYPES))
    tags |= {"masked_store"} if masked else set()
  expr = gen.full(out.dtype)
  if op and expr.op == "bcast":
    tags.add("atomic_broadcast_value")
  n_points = 1
  for g in grid:
    n_points *= g
  rounding = [_rounding(out.dtype)] * n_points if op == "add" else []
  body = dict(expr=expr, block=block, masked=masked, atomic=op,
              no_specs=kind == "store" and d.chance(0.5),
              tol=(tolerance([expr] + rounding, out.dtype),))
  if masked and not divisible:
    tags.add("window_past_end")
  tags |= expr.tags(loop_leaves(grid), unit_leaves(grid))
  return Case(seed, index, "tail", grid, tuple(ins), (out,),
              tuple(body.items()), None, None, aliases,
              frozenset(_tags(tags, ins, (out,), grid, False)))


def body_tail(case: Case, ctx) -> None:
  p = case.param
  block = p("block")
  starts = tuple(ctx.pid(a) * b for a, b in enumerate(block))
  mask = None
  if p("masked"):
    mask = ctx.xp.ones(block, bool)
    for a, (b, n) in enumerate(zip(block, case.inputs[0].shape)):
      mask = mask & (iota(ctx.xp, block, a) + starts[a] < n)
  env = {f"pid{a}": ctx.pid(a) for a in range(len(case.grid))}
  n_data = len(case.inputs) - len(case.aliases)
  for k in range(n_data):
    op = case.inputs[k]
    env[f"x{k}"] = ctx.load_window(k, starts, block, mask,
                                   fill_value(op.dtype))
  v = ctx.eval(p("expr"), env)
  if p("atomic"):
    ctx.atomic_window(p("atomic"), 0, (0,) * len(block), block, v, mask)
  else:
    ctx.store_window(0, starts, block, v, mask)


# ---- dma

def generate_dma(d: Draw, seed: int, index: int, tpu: bool) -> Case:
  dt = d.pick(["float32", "bfloat16", "int32", "float16", "int8"])
  out_dtype = d.pick(FLOATS + INTS)
  rows = max(sublane(dt), sublane(out_dtype)) * d.pick([1, 2])
  cols = 128 * d.pick([1, 2])
  n = d.int(1, 4)
  x = Operand((n * rows, cols), dt, space="any",
              nan=is_float(dt) and d.chance(0.1))
  dims = (Dim("blocked", rows, "axis", 0), Dim("blocked", cols, "const", 0))
  ins = [x]
  if d.chance(0.4):
    t = d.pick(FLOATS + INTS)
    ins.append(Operand((n * rows, cols), t, dims))
  out = Operand((n * rows, cols), out_dtype, dims)
  double = d.chance(0.5)
  slots = 2 if double else 1
  leaves = {f"x{k}": ((rows, cols), op.dtype) for k, op in enumerate(ins)}
  leaves["pid0"] = ((), "int32")
  expr = ExprGen(d.rng, leaves, (rows, cols), {"cast", "iota"},
                 d.int(1, 2)).full(out_dtype)
  body = dict(expr=expr, double=double, rows=rows,
              scratch=(("vmem", (slots, rows, cols), dt),
                       ("dma_sem", (slots,), None)),
              tol=(tolerance([expr], out_dtype),))
  semantics = ("arbitrary",) if double else d.pick(
      [None, ("parallel",), ("arbitrary",)])
  tags = {"dma", "dma_double" if double else "dma_single"} | expr.tags(
      loop_leaves((n,)), unit_leaves((n,)))
  return Case(seed, index, "dma", (n,), tuple(ins), (out,),
              tuple(body.items()), None, semantics, (),
              frozenset(_tags(tags, ins, (out,), (n,), True)))


def body_dma(case: Case, ctx) -> None:
  p = case.param
  rows, n = p("rows"), case.grid[0]
  i = ctx.pid(0)
  env = load_inputs(case, ctx, {})
  if p("double"):
    ctx.when(i == 0, lambda: ctx.dma_start(0, 0, rows, 0, 1, 0))
    ctx.when(i + 1 < n, lambda: ctx.dma_start(0, (i + 1) * rows, rows, 0, 1,
                                              (i + 1) % 2))
    slot = i % 2
  else:
    slot = 0
    ctx.dma_start(0, i * rows, rows, 0, 1, 0)
  ctx.dma_wait(0, i * rows, rows, 0, 1, slot)
  env["x0"] = ctx.buffer(0, slot)
  ctx.store(0, ctx.eval(p("expr"), env))
