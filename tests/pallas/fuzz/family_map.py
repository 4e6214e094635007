"""The `map` family: each grid point writes its own output blocks from a
random expression over input blocks.

Inputs follow the grid in every way a BlockSpec allows (permuted, reused
and reversed grid axes, constant blocks, a prefetched table, squeezed and
`Element` dims, whole arrays that broadcast); outputs are visited once each.
The body stores its expressions plainly, through `fori_loop`, `cond`,
`pl.when`, masked stores, or reads its output back and stores again.
Input padding that could reach a defined result is masked first (by
`jnp.where` or a masked load).
"""
from __future__ import annotations

import jax.numpy as jnp

from tests.pallas.fuzz.common import (Draw, bias_shape, input_dims,
                                      is_partial, load_inputs, loop_leaves,
                                      needs_mask, output_dims, predicate,
                                      small_block, tolerance, tpu_block,
                                      unit_leaves)
from tests.pallas.fuzz.expr import ExprGen
from tests.pallas.fuzz.spec import (DTYPES, Case, Operand, fill_value,
                                    is_float, is_int, valid_mask)

MODES = ("plain", "plain", "plain", "fori", "cond", "when", "masked_store",
         "readback", "readfirst")


def _operands(d: Draw, grid, tpu: bool, pf: bool, whole: bool):
  krank = d.pick([1, 2, 2, 3])
  in_dtypes = [d.pick(DTYPES) for _ in range(d.int(1, 3))]
  out_dtypes = [d.pick(DTYPES) for _ in range(1 + d.chance(0.25))]
  if whole:
    kshape = small_block(d, krank)
    ins = [Operand(kshape if d.chance(0.7) else bias_shape(d, kshape), t,
                   nan=is_float(t) and d.chance(0.1)) for t in in_dtypes]
    return kshape, ins, [Operand(kshape, t) for t in out_dtypes], ()
  kshape = tpu_block(d, krank, in_dtypes + out_dtypes) if tpu else \
      small_block(d, krank)
  ins = []
  for t in in_dtypes:
    if d.chance(0.15):
      ins.append(Operand(bias_shape(d, kshape), t))
    else:
      dims, shape = input_dims(d, grid, kshape, tpu, pf)
      ins.append(Operand(shape, t, dims, nan=is_float(t) and d.chance(0.1)))
  alias = d.chance(0.15)
  outs = []
  for j, t in enumerate(out_dtypes):
    dims, shape = output_dims(d, grid, kshape, tpu, pf,
                              spare=int(alias and j == 0))
    outs.append(Operand(shape, t, dims))
  aliases = ()
  if alias:
    aliases = ((len(ins), 0),)
    ins.append(outs[0])
  return kshape, ins, outs, aliases


def _features(grid, ins, outs, pf, tpu, whole) -> set[str]:
  tags = {f"grid{len(grid)}"}
  if tpu:
    tags.add("tpu_legal")
  if whole:
    tags.add("whole")
  for role, ops in (("in", ins), ("out", outs)):
    for op in ops:
      tags.add(f"dtype:{op.dtype}")
      if op.nan:
        tags.add("nan")
      if op.dims is None:
        tags.add(f"whole_{role}")
        continue
      if is_partial(op, grid, pf):
        tags.add(f"partial_{role}")
      axes = [x.axis for x in op.dims if x.src != "const"]
      if len(axes) != len(set(axes)):
        tags.add("reuse_axis")
      if axes != sorted(axes):
        tags.add("permute_axes")
      for x in op.dims:
        tags.add(f"dim:{x.kind}:{x.src}")
        if x.size == 1 and x.kind != "squeezed":
          tags.add("size1")
  return tags


def _mode_params(d: Draw, mode, gen, leaves, kshape, exprs, ins, outs,
                 grid):
  """(mode, its expressions and parameters) for the store `mode`."""
  out = outs[0].dtype
  if mode == "fori":
    exact = exprs[0].exact
    for _ in range(2):
      loop = ExprGen(d.rng, {**leaves, "v": (kshape, out, exact),
                             "t": ((), "int32")}, kshape,
                     gen.allow - {"dot"}, 2)
      step = loop.full(out)
      if step.exact or not exact:
        break
      exact = False     # the carried value is rounded after one trip
    return mode, dict(trips=d.int(1, 3), step=step)
  if mode in ("cond", "when"):
    ints = [k for k, op in enumerate(ins) if (is_int(op.dtype) or op.dtype ==
                                               "bool") and op.dims is not None]
    if grid and (not ints or d.chance(0.7)):
      a, m = d.int(0, len(grid) - 1), d.int(2, 3)
      pred = ("pid", a, m, d.int(0, m - 1))
    elif ints:
      pred = ("data", f"x{d.pick(ints)}")
    else:
      return "plain", dict(other=gen.full(out))
    return mode, dict(pred=pred, other=gen.full(out))
  if mode == "masked_store":
    return mode, dict(mask=gen.full("bool", exact=True), other=gen.full(out))
  if mode == "readback":
    back = ExprGen(d.rng, {**leaves, "o": (kshape, out, exprs[0].exact)},
                   kshape, {"cast", "iota"}, 2)
    return mode, dict(again=back.full(out))
  if mode == "readfirst":
    # the output block read before anything is written to it: its input
    # where it is aliased, poison (memory nobody wrote) where it is not
    first = ExprGen(d.rng, {**leaves, "o": (kshape, out, True)}, kshape,
                    {"cast", "iota"}, 2)
    return mode, dict(again=first.full(out))
  return mode, {}


def _input_masks(d: Draw, ins, outs, grid, prefetch, exprs, extra, rows):
  """How each input's padding is masked: always before cross-element
  operations, where it reaches a defined output, for a data predicate or a
  row read; otherwise now and then."""
  cross = any(e.cross for e in exprs)
  pred = extra.get("pred", ("",))
  masks = {}
  for k, op in enumerate(ins):
    if op.dims is None or not is_partial(op, grid, prefetch):
      continue
    if cross or pred == ("data", f"x{k}") or d.chance(0.2) \
        or needs_mask(op, outs, grid, prefetch) or any(r[0] == k for r in rows):
      masks[k] = d.pick(["where", "where", "masked_load"])
  return masks


def _leaves(d: Draw, ins, grid, pf):
  """Expression leaves, and maybe a static row read `x_ref[r]`."""
  leaves = {f"x{k}": (op.kshape, op.dtype) for k, op in enumerate(ins)}
  leaves.update({f"pid{a}": ((), "int32") for a in range(len(grid))})
  if pf:
    leaves["pf"] = ((), "int32")
  rows = ()
  cand = [k for k, op in enumerate(ins) if op.dims is not None
          and len(op.kshape) >= 2]
  if cand and d.chance(0.15):
    k = d.pick(cand)
    rows = ((k, d.int(-ins[k].kshape[0], ins[k].kshape[0] - 1)),)
    leaves[f"r{k}"] = (ins[k].kshape[1:], ins[k].dtype)
  return leaves, rows


def generate(d: Draw, seed: int, index: int, tpu: bool) -> Case:
  grid = tuple(d.int(1, 3) for _ in range(d.pick([0, 1, 1, 2, 2, 3])))
  whole = not grid and d.chance(0.5)
  pf = bool(grid) and not whole and d.chance(0.2)
  prefetch = tuple(int(v) for v in d.rng.permutation(grid[0])) if pf else None
  kshape, ins, outs, aliases = _operands(d, grid, tpu and not whole, pf, whole)
  leaves, rows = _leaves(d, ins, grid, pf)
  allow = {"cast", "iota"} | {f for f, p in (("reduce", 0.3), ("dot", 0.15),
                                             ("roll", 0.1), ("cum", 0.1))
                                   if d.chance(p)}
  gen = ExprGen(d.rng, leaves, kshape, allow, max_depth=d.int(1, 3))
  mode = d.pick(MODES)
  exprs = tuple(gen.full(op.dtype) for op in outs)
  mode, extra = _mode_params(d, mode, gen, leaves, kshape, exprs, ins, outs,
                             grid)
  all_exprs = list(exprs) + [v for v in extra.values() if hasattr(v, "cross")]
  masks = _input_masks(d, ins, outs, grid, prefetch, all_exprs, extra, rows)
  features = _features(grid, ins, outs, prefetch, tpu and not whole, whole)
  features |= {f"mode:{mode}"} | {f"mask:{m}" for m in masks.values()}
  if rows:
    features.add("row_index:" + ("negative" if rows[0][1] < 0 else "positive"))
  if mode == "masked_store" and extra["mask"].op == "bcast":
    features.add("masked_store_scalar_mask")
  features |= {"alias"} if aliases else set()
  if mode == "readfirst":
    features.add("aliased_read_first" if aliases else "unwritten_read")
  jvp = (any(is_float(op.dtype) for op in outs)
         and any(is_float(op.dtype) for op in ins) and d.chance(0.25))
  features |= {"jvp"} if jvp else set()
  features |= {"prefetch"} if pf else set()
  for e in all_exprs:
    features |= e.tags(loop_leaves(grid, extra=("t",)), unit_leaves(grid))
  if mode == "fori":   # inside the loop every program id is a loop's scalar
    features |= extra["step"].tags(loop_leaves(grid, range(len(grid)), "t"))
  body = dict(exprs=exprs, mode=mode, masks=tuple(sorted(masks.items())),
              rows=rows, tol=tuple(tolerance(all_exprs, op.dtype)
                                   for op in outs),
              none_squeeze=d.chance(0.5), no_specs=whole and d.chance(0.5),
              jvp=jvp, **extra)
  return Case(seed, index, "map", grid, tuple(ins), tuple(outs),
              tuple(body.items()), prefetch, None, aliases,
              frozenset(features))


def _row(case, ctx, k, r):
  op = case.inputs[k]
  xp = ctx.xp
  ok = valid_mask(op, ctx.ids, case.grid, ctx.pf, xp)[r]
  return xp.where(ok, ctx.row(k, r), xp.asarray(fill_value(op.dtype),
                                                ctx.row(k, r).dtype))


def body(case: Case, ctx) -> None:
  p = case.param
  env = load_inputs(case, ctx, dict(p("masks")))
  for k, r in p("rows"):
    env[f"r{k}"] = _row(case, ctx, k, r)
  exprs, mode = p("exprs"), p("mode")
  for j, e in enumerate(exprs[1:], start=1):
    ctx.store(j, ctx.eval(e, env))
  first = exprs[0]
  if mode == "plain":
    ctx.store(0, ctx.eval(first, env))
  elif mode == "fori":
    step = p("step")
    v = ctx.fori(p("trips"), lambda t, v: ctx.eval(step, {**env, "v": v,
                                                          "t": t}),
                 ctx.eval(first, env))
    ctx.store(0, v)
  elif mode == "cond":
    pred = predicate(ctx, env, p("pred"))
    ctx.store(0, ctx.cond(pred, lambda: ctx.eval(first, env),
                          lambda: ctx.eval(p("other"), env)))
  elif mode == "when":
    pred = predicate(ctx, env, p("pred"))
    ctx.when(pred, lambda: ctx.store(0, ctx.eval(first, env)))
    ctx.when(ctx.xp.logical_not(pred),
             lambda: ctx.store(0, ctx.eval(p("other"), env)))
  elif mode == "masked_store":
    mask = ctx.eval(p("mask"), env)
    ctx.store_masked(0, ctx.eval(first, env), mask)
    ctx.store_masked(0, ctx.eval(p("other"), env),
                     ctx.xp.logical_not(mask))
  elif mode == "readback":
    ctx.store(0, ctx.eval(first, env))
    ctx.store(0, ctx.eval(p("again"), {**env, "o": ctx.read_out(0)}))
  elif mode == "readfirst":
    ctx.store(0, ctx.eval(p("again"), {**env, "o": ctx.read_out(0)}))
  else:
    raise ValueError(mode)
