"""Inlined calls, `cond` (`pl.when`, `lax.cond`, `lax.switch`) and loops
(`fori_loop`, `while_loop`) as `scf.index_switch` / `scf.for` / `scf.while`;
loop carries may be vectors (the library infers one layout for a carry
across iterations)."""
from __future__ import annotations

from jax import lax
from dsl.core.jax_internals import arith, ir, scf

from dsl.core.jaxpr_walk import CALL_PRIMITIVES, call_body
from dsl.core.normalize import scan_layout
from dsl.core.primitives import run_scoped_p
from lowering_mosaic.gpu.mesh_accumulators import nested_scope_p
from lowering_mosaic.gpu.host import TRITON_HINT, index_cast_i32, typed
from lowering_mosaic.gpu.rules import TABLE


@TABLE.register(*CALL_PRIMITIVES)
def _call(ctx, *args, **params):
  body = call_body(params, args)
  if body is None:
    raise ctx.error("call without a body")
  jaxpr, consts, operands = body
  return ctx.lower(jaxpr, consts, operands)


def _branch(ctx, closed, args):
  outs = ctx.lower_closed(closed, args)
  scf.yield_(outs)


@TABLE.register(lax.cond_p)
def _cond(ctx, index, *args, branches, **_):
  """`scf.index_switch` (the region op the library infers layouts
  through): case k runs branch k, the default runs the last branch."""
  if ir.IntegerType(index.type).width == 1:
    index = arith.extui(ir.IntegerType.get_signless(32), index)
  index = arith.index_cast(ir.IndexType.get(), index_cast_i32(index))
  result_types = [typed(a.shape, a.dtype) for a in ctx.avals_out]
  n = len(branches)
  op = scf.IndexSwitchOp(result_types, index, list(range(n - 1)))
  for block, branch in zip(list(op.case_blocks) + [op.default_block],
                           branches):
    with ir.InsertionPoint(block):
      _branch(ctx, branch, args)
  return list(op.results)


@TABLE.register(lax.scan_p)
def _scan(ctx, *args, jaxpr, length, reverse, **params):
  """`fori_loop` with static bounds: a scan whose first carry is the
  counter and that has no stacked inputs or outputs."""
  num_consts, num_carry, n_xs, n_ys = scan_layout(params)
  if n_xs or n_ys:
    raise ctx.error("lax.scan over arrays is not supported by the Mosaic GPU "
                    "lowering; use fori_loop" + TRITON_HINT)
  consts, carry = list(args[:num_consts]), list(args[num_consts:])
  lo, hi, one = (arith.constant(ir.IndexType.get(), v) for v in (0, length, 1))
  for_op = scf.ForOp(lo, hi, one, carry)
  with ir.InsertionPoint(for_op.body):
    outs = ctx.lower_closed(jaxpr, consts + list(for_op.inner_iter_args))
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
    (pred,) = ctx.lower_closed(cond_jaxpr, cconsts + list(before.arguments))
    scf.condition(pred, list(before.arguments))
  after = op.after.blocks.append(*types)
  with ir.InsertionPoint(after):
    outs = ctx.lower_closed(body_jaxpr, bconsts + list(after.arguments))
    scf.yield_(outs)
  return list(op.results)


@TABLE.register(run_scoped_p, nested_scope_p)
def _run_scoped(ctx, *consts, jaxpr, num_consts, collective_axes=(), **_):
  """The scope's refs come from the host: buffers the plan set aside for
  this equation, or (a plgpu kernel) allocations made here."""
  with ctx.host.scope(ctx, jaxpr, num_consts, collective_axes) as refs:
    body = ctx.host.scope_body(jaxpr, num_consts)
    outs = ctx.lower(body, (), list(consts) + list(refs))
    return outs[:len(jaxpr.outvars)]
