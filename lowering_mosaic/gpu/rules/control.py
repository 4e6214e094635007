"""Inlined calls, `cond` (`pl.when`, `lax.cond`) and loops (`fori_loop`)
as `scf.if` / `scf.for`; loop carries may be vectors (the library infers
one layout for a carry across iterations)."""
from __future__ import annotations

from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, scf

from dsl.jaxpr_walk import CALL_PRIMITIVES, call_body
from lowering_mosaic.gpu.host import (TABLE, TRITON_HINT, i32, index_cast_i32,
                                      typed)


@TABLE.register(*CALL_PRIMITIVES)
def _call(ctx, *args, **params):
  body = call_body(params, args)
  if body is None:
    raise ctx.error("call without a body")
  jaxpr, consts, operands = body
  return ctx.lower(jaxpr, consts, operands)


def _branch(ctx, closed, args):
  outs = ctx.lower(closed.jaxpr, closed.consts, args)
  scf.yield_(outs)


@TABLE.register(lax.cond_p)
def _cond(ctx, index, *args, branches, **_):
  out_avals = ctx.avals_out
  if len(branches) != 2:
    raise ctx.error("lax.switch with more than two branches is not supported "
                    "by the Mosaic GPU lowering" + TRITON_HINT)
  pred = index
  if ir.IntegerType(index.type).width != 1:
    pred = arith.cmpi(arith.CmpIPredicate.ne, index_cast_i32(index), i32(0))

  result_types = [typed(a.shape, a.dtype) for a in out_avals]
  if_op = scf.IfOp(pred, result_types, has_else=True)
  with ir.InsertionPoint(if_op.then_block):
    _branch(ctx, branches[1], args)
  with ir.InsertionPoint(if_op.else_block):
    _branch(ctx, branches[0], args)
  return list(if_op.results)


@TABLE.register(lax.scan_p)
def _scan(ctx, *args, jaxpr, length, num_consts, num_carry, reverse, **_):
  """`fori_loop` with static bounds: a scan whose first carry is the
  counter and that has no stacked inputs or outputs."""
  n_xs = len(args) - num_consts - num_carry
  if n_xs or len(jaxpr.jaxpr.outvars) != num_carry:
    raise ctx.error("lax.scan over arrays is not supported by the Mosaic GPU "
                    "lowering; use fori_loop" + TRITON_HINT)
  consts, carry = list(args[:num_consts]), list(args[num_consts:])
  lo, hi, one = (arith.constant(ir.IndexType.get(), v) for v in (0, length, 1))
  for_op = scf.ForOp(lo, hi, one, carry)
  with ir.InsertionPoint(for_op.body):
    outs = ctx.lower(jaxpr.jaxpr, jaxpr.consts,
                     consts + list(for_op.inner_iter_args))
    scf.yield_(outs)
  return list(for_op.results)


@TABLE.register(lax.while_p)
def _while(ctx, *args, cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts):
  cconsts = list(args[:cond_nconsts])
  bconsts = list(args[cond_nconsts:cond_nconsts + body_nconsts])
  carry = list(args[cond_nconsts + body_nconsts:])
  types = [c.type for c in carry]
  op = scf.WhileOp(types, carry)
  before = op.before.blocks.append(*types)
  with ir.InsertionPoint(before):
    (pred,) = ctx.lower(cond_jaxpr.jaxpr, cond_jaxpr.consts,
                        cconsts + list(before.arguments))
    scf.condition(pred, list(before.arguments))
  after = op.after.blocks.append(*types)
  with ir.InsertionPoint(after):
    outs = ctx.lower(body_jaxpr.jaxpr, body_jaxpr.consts,
                     bconsts + list(after.arguments))
    scf.yield_(outs)
  return list(op.results)
