"""Control flow: `scf.for`, `scf.if`, `scf.while` become the model's
loops and branches (integers they carry become process variables),
`tpu.region` (run_scoped) a scope whose buffers and semaphores end with it.
"""
from __future__ import annotations

from lowering_mosaic.verification.promela import model as M
from lowering_mosaic.verification.promela.model import Expr, var
from lowering_mosaic.verification.promela.mosaic_ir import (ModelError,
                                                            handles, is_int,
                                                            location_of)


@handles("scf.for")
def _for(x, op, env, out):
  lo, hi, step = (x.int_value(env, v) for v in op.operands[:3])
  inits = list(op.operands[3:])
  body = op.regions[0].blocks[0]
  bargs = list(body.arguments)
  known = None not in (lo, hi, step)
  iv = x.fresh("i") if known else None
  if not known:
    x.note("a loop with bounds the model does not track runs any number of "
           "times")
  benv = dict(env)
  benv[bargs[0]] = var(iv) if known else None
  carried = []
  for a, init in zip(bargs[1:], inits):
    if is_int(a.type):
      c = x.fresh("c")
      carried.append((c, x.int_value(env, init)))
      benv[a] = var(c)
    else:
      benv[a] = None
  info = x.info(op, "loop")
  stmts, yields = x.block(body, benv)
  ys = [y if isinstance(y, Expr) else None
        for a, y in zip(bargs[1:], yields) if is_int(a.type)]
  out.append(M.Loop(iv, lo, hi, step, carried, stmts, ys, info))
  k = 0
  for a, r in zip(bargs[1:], op.results):
    if is_int(a.type):
      env[r] = var(carried[k][0])
      k += 1
    else:
      env[r] = None


@handles("scf.if")
def _if(x, op, env, out):
  cond = x.int_value(env, op.operands[0])
  then_b = op.regions[0].blocks[0]
  then, ty = x.block(then_b, dict(env))
  orelse, ey = [], []
  if len(op.regions) > 1 and len(op.regions[1].blocks):
    orelse, ey = x.block(op.regions[1].blocks[0], dict(env))
  results, tys, eys = [], [], []
  for k, r in enumerate(op.results):
    if is_int(r.type):
      name = x.fresh("r")
      results.append(name)
      tys.append(ty[k] if k < len(ty) and isinstance(ty[k], Expr) else None)
      eys.append(ey[k] if k < len(ey) and isinstance(ey[k], Expr) else None)
      env[r] = var(name)
    else:
      env[r] = None
  if cond is not None and cond.const is not None:
    # A static branch: keep only the side that runs.
    taken, ys = (then, tys) if cond.const else (orelse, eys)
    out.extend(taken)
    for name, y in zip(results, ys):
      out.append(M.Assign(name, y))
    return
  if cond is None:
    x.note("a branch on a value the model does not track may go either way")
  out.append(M.If(cond, then, orelse, results, tys, eys,
                  x.info(op, "branch")))


@handles("scf.while")
def _while(x, op, env, out):
  inits = list(op.operands)
  before = op.regions[0].blocks[0]
  after = op.regions[1].blocks[0]
  carried, benv = [], dict(env)
  for a, init in zip(before.arguments, inits):
    if is_int(a.type):
      c = x.fresh("w")
      carried.append((c, x.int_value(env, init)))
      benv[a] = var(c)
    else:
      benv[a] = None
  info = x.info(op, "while loop")
  bstmts, cvals = x.block(before, benv)
  cond = cvals[0] if cvals and isinstance(cvals[0], Expr) else None
  passed = cvals[1:]
  aenv, after_vars = dict(env), []
  for a, pv in zip(after.arguments, passed):
    if is_int(a.type):
      n = x.fresh("a")
      after_vars.append((n, pv if isinstance(pv, Expr) else None))
      aenv[a] = var(n)
    else:
      aenv[a] = None
  astmts, yvals = x.block(after, aenv)
  yields = [y if isinstance(y, Expr) else None
            for a, y in zip(before.arguments, yvals) if is_int(a.type)]
  results = []
  for r, pv in zip(op.results, passed):
    if is_int(r.type):
      n = x.fresh("q")
      results.append((n, pv if isinstance(pv, Expr) else None))
      env[r] = var(n)
    else:
      env[r] = None
  if cond is None:
    x.note("a while loop whose condition the model does not track runs any "
           "number of times")
  out.append(M.While(carried, bstmts, cond, after_vars, astmts, yields,
                     results, info))


@handles("tpu.region")
def _region(x, op, env, out):
  x.scopes.append([])
  stmts, _ = x.block(op.regions[0].blocks[0], dict(env))
  scope = x.scopes.pop()
  out.extend(stmts)
  bufs = [b for b in scope if isinstance(b, M.Buffer)]
  sems = [s for s in scope if isinstance(s, M.SemArray)]
  if bufs or sems:
    out.append(M.ScopeEnd(bufs, sems, x.info(op, "end of run_scoped")))
  for r in op.results:
    env[r] = None


@handles("func.call")
def _call(x, op, env, out):
  raise ModelError(f"func.call at {location_of(op)[0]}: calls are not "
                   "modelled (the lowering inlines them)")
