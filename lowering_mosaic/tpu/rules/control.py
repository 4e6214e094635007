"""Control flow -> `scf`; calls are inlined; `run_scoped` -> `tpu.region`.

- `cond` -> `scf.if` (a chain of them for more than two branches)
- `scan` without xs/ys (what `fori_loop` and `pl.loop` make) -> `scf.for`
  over i32, a fori_loop's counter as the induction variable
- `while` -> `scf.while` (`scf.for` for a fori_loop with dynamic bounds)
- `pjit`/`closed_call`/`custom_jvp_call`/`custom_vjp_call` -> inlined
- `run_scoped` -> `tpu.region` holding `memref.alloca` (VMEM/SMEM) and
  `tpu.sem_alloc` (semaphores) for the scoped refs
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from dsl.core.jax_internals import (arith, ClosedJaxpr, core, ir, memref, scf,
                                    tpu)

from dsl.core import primitives as dsl_primitives
from dsl.core.jaxpr_walk import CALL_PRIMITIVES, call_body
from dsl.core.semaphores import SemaphoreSpace
from lowering_mosaic import dialect
from lowering_mosaic.tpu import emit
from lowering_mosaic.tpu.host import RefVal, constant, i32_const
from lowering_mosaic.tpu.rules import register


def _result_types(ctx, avals):
  types = []
  for a in avals:
    if not hasattr(a, "shape") or hasattr(a, "inner_aval"):
      raise ctx.error("cannot return refs from control flow")
    types.append(emit.vtype(a.shape, a.dtype))
  return types


def _closed(j):
  if isinstance(j, ClosedJaxpr):
    return j.jaxpr, j.consts
  return j, ()


def _lower_branch(ctx, branch, args):
  jaxpr, consts = _closed(branch)
  return ctx.lower(jaxpr, consts, args)


@register(lax.cond_p)
def _cond(ctx, index, *args, branches, **params):
  """`scf.if (index != 0)` with branch 0 in the else region (the form
  Pallas emits: `pl.when` becomes an `scf.if` without an else once the
  empty branch is canonicalized away); more branches nest in the then
  region with index - 1."""
  out_types = _result_types(ctx, ctx.avals_out)
  idx_dtype = ctx.avals_in[0].dtype

  def build(idx, branches):
    if len(branches) == 1:
      return _lower_branch(ctx, branches[0], args)
    if emit.is_bool(idx_dtype):
      pred = idx
    else:
      pred = arith.CmpIOp(arith.CmpIPredicate.ne, idx,
                          constant(0, (), idx_dtype)).result
    op = scf.IfOp(pred, out_types, has_else=True)
    with ir.InsertionPoint(op.then_block):
      rest = idx if len(branches) == 2 else arith.SubIOp(
          idx, constant(1, (), idx_dtype)).result
      scf.YieldOp(build(rest, branches[1:]))
    with ir.InsertionPoint(op.else_block):
      scf.YieldOp(_lower_branch(ctx, branches[0], args))
    return list(op.results)

  return build(index, list(branches))


def _scan_parts(args, params):
  if "ft_in" in params:
    consts, carry, xs = (list(p) for p in
                         params["ft_in"].update(list(args)).unpack())
    return consts, carry, xs
  nc, ncar = params["num_consts"], params["num_carry"]
  return list(args[:nc]), list(args[nc:nc + ncar]), list(args[nc + ncar:])


def _counts_first_carry(body, n_consts) -> bool:
  """The scan body is a fori_loop's: its first carry is the loop index
  (the body returns it plus one)."""
  if len(body.invars) <= n_consts:
    return False
  i, out = body.invars[n_consts], body.outvars[0]
  for eqn in body.eqns:
    if out in eqn.outvars:
      if eqn.primitive is not lax.add_p:
        return False
      a, b = eqn.invars
      if b is i:
        a, b = b, a
      return (a is i and isinstance(b, core.Literal) and b.val == 1
              and i.aval.shape == () and i.aval.dtype == jnp.int32)
  return False


def _static_start(ctx, n_consts):
  """The fori_loop's start when it is a literal, else None."""
  atom = ctx.eqn.invars[n_consts] if ctx.eqn is not None else None
  return int(atom.val) if isinstance(atom, core.Literal) else None


def _fori(ctx, body, body_consts, consts, carry, length, unroll):
  """A fori_loop as in Pallas: fully unrolled (the body once per index, the
  index a constant) when `unroll` covers a loop with a literal start, else
  `scf.for` over the index (`tpu.late_unroll` asks Mosaic to unroll by
  `unroll`)."""
  start = _static_start(ctx, len(consts))
  if start is not None and unroll >= length > 0:
    state = carry[1:]
    for i in range(start, start + length):
      state = ctx.lower(body, body_consts,
                            consts + [i32_const(i)] + list(state))[1:]
    return [i32_const(start + length)] + list(state)
  lb = carry[0]
  ub = arith.AddIOp(lb, i32_const(int(length))).result
  loop = scf.ForOp(lb, ub, i32_const(1), carry[1:])
  if unroll > 1:
    loop.attributes["tpu.late_unroll"] = ir.IntegerAttr.get(
        ir.IntegerType.get_signless(32), int(unroll))
  with ir.InsertionPoint(loop.body):
    outs = ctx.lower(body, body_consts, consts + [loop.induction_variable]
                         + list(loop.inner_iter_args))
    scf.YieldOp(outs[1:])
  return [ub] + list(loop.results)


@register(lax.scan_p)
def _scan(ctx, *args, jaxpr, length, reverse, unroll=1, **params):
  """`scf.for` over i32. A fori_loop's counter becomes the induction
  variable (from its start to start + length), as in Pallas."""
  consts, carry, xs = _scan_parts(args, params)
  body, body_consts = _closed(jaxpr)
  n_carry = len(carry)
  if xs or len(body.outvars) != n_carry:
    raise ctx.error("scan over arrays (xs/ys) is not supported by the Mosaic "
                    "lowering; use lax.fori_loop / pl.loop over refs")
  del reverse   # the body keeps its own counter in the carry
  unroll = int(length) if unroll is True else int(unroll or 1)
  if _counts_first_carry(body, len(consts)):
    return _fori(ctx, body, body_consts, consts, carry, int(length), unroll)
  loop = scf.ForOp(i32_const(0), i32_const(int(length)), i32_const(1), carry)
  with ir.InsertionPoint(loop.body):
    outs = ctx.lower(body, body_consts,
                         consts + list(loop.inner_iter_args))
    scf.YieldOp(outs)
  return list(loop.results)


def _is_fori_while(cond_jaxpr, cond_nconsts, body, body_nconsts) -> bool:
  """The while loop is a fori_loop with dynamic bounds: carry (i, upper,
  ...), the condition `i < upper`, the body adds 1 to i, keeps upper."""
  cond = _closed(cond_jaxpr)[0]
  if cond_nconsts or len(cond.invars) < 2 or len(cond.eqns) != 1:
    return False
  i, upper = cond.invars[:2]
  eqn = cond.eqns[0]
  if (eqn.primitive is not lax.lt_p or list(eqn.invars) != [i, upper]
      or eqn.outvars != cond.outvars):
    return False
  if any(v.aval.shape != () or v.aval.dtype != jnp.int32 for v in (i, upper)):
    return False
  return (body.outvars[1] is body.invars[body_nconsts + 1]
          and _counts_first_carry(body, body_nconsts))


@register(lax.while_p)
def _while(ctx, *args, cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts):
  """`scf.while`; a fori_loop with dynamic bounds becomes `scf.for` from
  its start to its end (as in Pallas)."""
  cconsts = list(args[:cond_nconsts])
  bconsts = list(args[cond_nconsts:cond_nconsts + body_nconsts])
  init = list(args[cond_nconsts + body_nconsts:])
  body, body_consts = _closed(body_jaxpr)
  if _is_fori_while(cond_jaxpr, cond_nconsts, body, body_nconsts):
    lb, ub = init[:2]
    # the end is the start plus the trip count (as Pallas), which keeps
    # `lb + (ub - lb)` where `ub` alone would fold
    end = arith.AddIOp(lb, arith.SubIOp(ub, lb).result).result
    loop = scf.ForOp(lb, end, i32_const(1), init[2:])
    with ir.InsertionPoint(loop.body):
      outs = ctx.lower(body, body_consts, bconsts + [
          loop.induction_variable, ub] + list(loop.inner_iter_args))
      scf.YieldOp(outs[2:])
    return [arith.MaxSIOp(lb, ub).result, ub] + list(loop.results)
  types = [v.type for v in init]
  op = scf.WhileOp(types, init)
  before = op.before.blocks.append(*types)
  with ir.InsertionPoint(before):
    (pred,) = _lower_branch(ctx, cond_jaxpr, cconsts + list(before.arguments))
    scf.ConditionOp(pred, list(before.arguments))
  after = op.after.blocks.append(*types)
  with ir.InsertionPoint(after):
    scf.YieldOp(_lower_branch(ctx, body_jaxpr, bconsts + list(after.arguments)))
  return list(op.results)


@register(*CALL_PRIMITIVES)
def _inline(ctx, *args, **params):
  body = call_body(params, args)
  if body is None:
    raise ctx.error("has no jaxpr to inline")
  return ctx.lower(*body)


@register(dsl_primitives.run_scoped_p)
def _run_scoped(ctx, *consts, jaxpr, num_consts, **params):
  out_types = _result_types(ctx, ctx.avals_out)
  region = tpu.RegionOp(out_types)
  block = region.regions[0].blocks.append() if not len(
      region.regions[0].blocks) else region.regions[0].blocks[0]
  with ir.InsertionPoint(block):
    scoped = []
    for k, v in enumerate(jaxpr.invars[num_consts:]):
      aval = v.aval
      t = dialect.ref_memref_type(aval, dialect.VMEM)
      ms = aval.memory_space
      if isinstance(ms, SemaphoreSpace):
        val = tpu.AllocaSemaphoreOp(t).result
        space = dialect.SEMAPHORE_MEM
      else:
        space = dialect.space_name(ms, dialect.VMEM)
        val = memref.AllocaOp(t, [], []).result
      scoped.append(RefVal(val, aval, space, f"run_scoped ref {k}"))
    outs = ctx.lower(jaxpr, (), list(consts) + scoped)
    tpu.YieldOp(outs)
  return list(region.results)
